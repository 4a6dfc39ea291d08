"""The draft model of speculative decoding: a second model, in the target's runner, that proposes tokens.

The scheduler decides how many tokens each request verifies and sends that many placeholders
(``core.speculative.DRAFT_PLACEHOLDER``); at the start of the step, before the target's forward pass, the draft
replaces them with its own greedy tokens. A deterministic proposal is what the target's verification assumes
(``runner.spec_verify``), so greedy outputs stay token-identical and sampled ones keep their distribution: the
draft decides only how many tokens a step gains.

Its KV cache is its own tensors but the target's blocks: block ``b`` of a request holds the target's K/V in the
target's cache and the draft's in the draft's, so the scheduler's allocation (lookahead slots included) and its
rollback serve both, and nothing in ``core`` knows the draft exists (vLLM's draft and EAGLE proposers share the
block table the same way). What differs is how far each is computed: ``RequestState.draft_computed`` counts the
leading tokens whose draft K/V is written. Each step the draft runs the step's prompt chunks (so a prompt costs
its draft pass in the prefill steps, which the scheduler's length rule does not fit on, and not in the first
step that verifies) and catches up every request about to verify on the tokens since its last (one or two
between verifying steps, more after steps without), in one pass; then it runs one single-token pass per further
proposed token, every verifying request batched in each pass.

Proposals past the accepted ones leave draft K/V at positions the next tokens overwrite; ``verified`` pulls
``draft_computed`` back to what the accepted tokens make true. A request that is preempted comes back as a new
state (``draft_computed`` 0) and catches up from its first token; so does one admitted with a prefix-cache hit,
since the shared blocks' draft K/V may never have been written. Where blocks outside a sliding window were given
back (``core.sliding_window``; only when the draft's layers are windowed too), that catch-up writes the draft K/V of
those positions into the draft's own null block (the target's stays zero), which the draft's attention near the
window's start then reads: its proposals there may be worse, the target's tokens are unchanged (it verifies each).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from conveyor.core.outputs import SchedulerOutput
from conveyor.core.speculative import DRAFT_PLACEHOLDER
from conveyor.layers.attention import make_attention, resolve_backend
from conveyor.models.build import ModelInfo, resolve_dtype
from conveyor.runner.input_batch import InputBatch, RequestState, flatten


class DraftModel:
    """A loaded model that proposes for the requests of ``InputBatch`` ``batch`` (the target runner's), on the
    target's block table (``num_blocks`` x ``block_size``)."""

    def __init__(self, model: torch.nn.Module, info: ModelInfo, block_size: int, device: str | torch.device,
                 attention_backend: str, allocate_kv: Callable[[str, ModelInfo], list[torch.Tensor]]) -> None:
        """``allocate_kv(backend, info)``: the target runner's allocation of a model's caches over its blocks."""
        self.model, self.info = model, info
        self.device = torch.device(device)
        self.block_size = block_size
        self.dtype = resolve_dtype(info.dtype)
        self.backend = resolve_backend(attention_backend, self.device, self.dtype, info.head_dim, block_size)
        self.kv_caches = allocate_kv(self.backend, info)

    def propose(self, so: SchedulerOutput, batch: InputBatch) -> dict[str, list[int]]:
        """The draft's tokens for every request whose entry in ``so.scheduled_spec_tokens`` holds placeholders
        (as many as it holds), each request's K/V written up to its last proposal but one. Prompt chunks of the
        step are run through the draft too, so that a request's first proposal does not pay for its prompt."""
        wanted = {rid: len(tokens) for rid, tokens in so.scheduled_spec_tokens.items()
                  if tokens and tokens[0] == DRAFT_PLACEHOLDER}
        chunk_ends = {rid: batch.requests[rid].num_computed_tokens + n for rid, n in so.num_scheduled_tokens.items()
                      if n > 1 and rid not in so.scheduled_spec_tokens}
        chunks = [s for s in map(batch.requests.get, chunk_ends) if s.draft_computed < chunk_ends[s.req_id]]
        if not wanted and not chunks:
            return {}
        states = [batch.requests[rid] for rid in wanted]
        # the first pass: every verifying request's tokens since the draft's last, ending with the one the
        # target computes now, and every prompt chunk (with whatever the draft has not seen before it)
        rows = [(s, s.draft_computed, s.token_ids[s.draft_computed:]) for s in states]
        rows += [(s, s.draft_computed, s.token_ids[s.draft_computed:chunk_ends[s.req_id]]) for s in chunks]
        firsts = self._pass(batch, rows)
        for s in chunks:
            s.draft_computed = chunk_ends[s.req_id]
        proposals = {s.req_id: [token] for s, token in zip(states, firsts)}
        for i in range(1, max(wanted.values(), default=0)):
            active = [s for s in states if wanted[s.req_id] > i]
            nexts = self._pass(batch, [(s, len(s.token_ids) + i - 1, proposals[s.req_id][-1:]) for s in active])
            for s, token in zip(active, nexts):
                proposals[s.req_id].append(token)
        for s in states:  # written: its tokens and every proposal but the last
            s.draft_computed = len(s.token_ids) + wanted[s.req_id] - 1
        return proposals

    @staticmethod
    def verified(state: RequestState) -> None:
        """After the target appended what it accepted (and the token after): draft K/V past the request's last
        accepted proposal was written from rejected tokens."""
        state.draft_computed = min(state.draft_computed, len(state.token_ids) - 1)

    def _pass(self, batch: InputBatch, rows: list[tuple[RequestState, int, list[int]]]) -> list[int]:
        """One forward pass of the draft over ``rows`` (state, position of the first token, tokens), writing their
        K/V; the greedy next token after each row's last, in ``rows`` order."""
        # single-token rows first, shortest context first, as the target's steps order them for the attention
        order = sorted(range(len(rows)), key=lambda i: (len(rows[i][2]) != 1, rows[i][1]))
        flat = flatten(batch.block_table, np.array([rows[i][0].row for i in order], dtype=np.int64),
                       np.array([rows[i][1] for i in order], dtype=np.int64),
                       np.array([len(rows[i][2]) for i in order], dtype=np.int64), self.block_size, self.device)
        dev = self.device
        input_ids = torch.tensor([t for i in order for t in rows[i][2]], dtype=torch.int64, device=dev)
        attn = make_attention(self.backend, flat.meta, self.dtype, None)
        hidden = self.model(input_ids, torch.from_numpy(flat.positions).to(dev), self.kv_caches, attn)
        last = torch.from_numpy(flat.query_start[1:] - 1).to(dev)
        tokens = self.model.compute_logits(hidden.index_select(0, last)).argmax(dim=-1).tolist()
        by_row = [0] * len(rows)
        for slot, i in enumerate(order):
            by_row[i] = tokens[slot]
        return by_row
