"""Per-request runner state across steps, and the one function that flattens a step into tensors.

The runner mirrors vLLM v1: a request arrives whole once (NewRequestData), then as deltas (CachedRequestData).
Its block ids live in a persistent numpy block table (one row per live request), so a step only appends the
new block ids instead of rebuilding every table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from conveyor.core.block_pool import cdiv
from conveyor.core.outputs import SchedulerOutput, is_decode
from conveyor.core.sampling_params import SamplingParams
from conveyor.layers.attention import AttentionMetadata, Padding
from conveyor.runner.pooler import PoolRows

# The persistent block table starts with room for this many requests x blocks each and doubles when outgrown.
INITIAL_TABLE_ROWS = 64
INITIAL_TABLE_COLS = 64


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + every token sampled so far (the runner appends its own samples)
    num_prompt_tokens: int
    params: SamplingParams
    num_computed_tokens: int
    row: int  # row in the persistent block table
    num_blocks: int
    generator: torch.Generator | None  # only for seeded requests
    error: str | None = None  # per-request setup failed: computed as usual, sampled token discarded
    matcher: Any = None  # llguidance matcher of a constrained request (conveyor.structured), else None
    draft_computed: int = 0  # leading tokens whose K/V the draft model has written (runner.draft_model)
    # KV eviction (core.kv_eviction): tokens whose blocks left its table; its KV slot of position p is
    # p - num_evicted_tokens, and attention sees num_computed - num_evicted cached keys
    num_evicted_tokens: int = 0
    num_skipped_blocks: int = 0  # leading table entries set to the null block (outside every sliding window)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def slot_mapping_of(block_table: np.ndarray, req_of_token: np.ndarray, positions: np.ndarray,
                    block_size: int) -> np.ndarray:
    """The cache slot of each token: its request's block (``block_table`` row ``req_of_token``) holding its
    position, and the offset in it."""
    return block_table[req_of_token, positions // block_size] * block_size + positions % block_size


@dataclass(frozen=True)
class FlatStep:
    """Requests' new tokens laid on one axis, request after request (``flatten``)."""

    query_start: np.ndarray  # [R + 1]: request i's tokens are query_start[i] .. query_start[i + 1] - 1
    positions: np.ndarray  # [T]: each token's RoPE position
    seq_lens: np.ndarray  # [R]: the tokens each request has once the step is done
    meta: AttentionMetadata

    @property
    def num_tokens(self) -> int:
        return int(self.query_start[-1])


def flatten(table: np.ndarray, rows: np.ndarray, computed: np.ndarray, num_new: np.ndarray, block_size: int,
            device, evicted: np.ndarray | None = None) -> FlatStep:
    """One forward pass's token axis and attention metadata for requests whose block tables are ``table``'s
    ``rows``, each with ``computed`` tokens and ``num_new`` new ones, single-token (decode) requests first.
    ``evicted``: the tokens a KV eviction policy dropped from each. Attention and the cache work in KV slots,
    RoPE in positions; they differ by those tokens (None or all zero: the same arrays, the step unchanged).
    The target's steps (``InputBatch.prepare``) and the draft model's passes both lay out their tokens here."""
    seq_lens = computed + num_new
    shifted = evicted is not None and bool(evicted.any())
    kv_computed, kv_seq_lens = (computed - evicted, seq_lens - evicted) if shifted else (computed, seq_lens)
    query_start = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start[1:])
    num_tokens = int(query_start[-1])
    # positions[t] = computed[req(t)] + (t - query_start[req(t)])
    req_of_token = np.repeat(np.arange(len(rows)), num_new)
    positions = np.arange(num_tokens) + np.repeat(computed - query_start[:-1], num_new)
    max_blocks = cdiv(int(kv_seq_lens.max()), block_size) if len(rows) else 0
    block_table = table[rows, :max_blocks]
    slots = positions - np.repeat(evicted, num_new) if shifted else positions
    slot_mapping = slot_mapping_of(block_table, req_of_token, slots, block_size)
    meta = AttentionMetadata(
        num_tokens=num_tokens, block_size=block_size, slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc=query_start.tolist(), seq_lens=kv_seq_lens.tolist(), num_computed=kv_computed.tolist(),
        block_table=torch.from_numpy(block_table).to(device), num_decodes=int((num_new == 1).sum()),
        slots_shifted=shifted, rope_offsets=evicted.tolist() if shifted else None)
    return FlatStep(query_start, positions, seq_lens, meta)


@dataclass
class SamplingMetadata:
    """What the sampler needs of a step's sampling rows, decided once in ``InputBatch.prepare`` (vLLM's
    ``SamplingMetadata``): which rows take which treatment, and the per-row tensors of the rows that draw.
    Row lists are logits rows (positions in ``reqs``)."""

    reqs: list[RequestState]  # in logits row order
    plain_greedy: bool  # every row greedy with no logprobs, penalties, logit edits or min_tokens ban: argmax only
    logprob_rows: list[int]
    edited_rows: list[int]  # allowed_token_ids, bad_words, logit_bias
    penalised_rows: list[int]
    below_min_tokens: list[int]  # rows whose stop tokens are banned this step
    random_rows: list[int]  # rows that draw (temperature > 0); the tensors below are theirs, in this order
    temperatures: torch.Tensor | None  # [len(random_rows)] float32
    min_ps: torch.Tensor | None  # [len(random_rows)] float32, None when no row uses min-p
    top_ks: list[int]  # 0: off
    top_ps: list[float]  # 1.0: off

    @property
    def truncates(self) -> bool:
        """Whether any drawing row has a top-k or top-p."""
        return any(self.top_ks) or any(p < 1.0 for p in self.top_ps)

    @classmethod
    def build(cls, reqs: list[RequestState], device: torch.device | str = "cpu") -> SamplingMetadata:
        params = [r.params for r in reqs]
        below_min = [i for i, r in enumerate(reqs) if r.num_output_tokens < r.params.min_tokens]
        plain = not below_min and all(p.greedy and p.logprobs is None and not p.has_penalties
                                      and not p.has_logit_edits for p in params)
        random_rows = [] if plain else [i for i, p in enumerate(params) if not p.greedy]
        drawing = [params[i] for i in random_rows]
        temps = torch.tensor([p.temperature for p in drawing], device=device) if drawing else None
        min_ps = [p.min_p for p in drawing]
        return cls(reqs, plain, logprob_rows=[i for i, p in enumerate(params) if p.logprobs is not None],
                   edited_rows=[i for i, p in enumerate(params) if p.has_logit_edits],
                   penalised_rows=[i for i, p in enumerate(params) if p.has_penalties],
                   below_min_tokens=below_min, random_rows=random_rows, temperatures=temps,
                   min_ps=torch.tensor(min_ps, device=device) if any(min_ps) else None,
                   top_ks=[p.top_k for p in drawing], top_ps=[p.top_p for p in drawing])


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T + pad]
    positions: torch.Tensor  # [T + pad]
    attn_meta: AttentionMetadata  # of the T real tokens
    padding: Padding | None  # a baseline's pad rows after the real ones (None: no padding this step)
    logits_indices: torch.Tensor | None  # rows of the hidden states that sample; None: every row samples
    sampling: list[RequestState]  # in logits row order
    sampling_meta: SamplingMetadata  # of ``sampling``
    prompt_rows: list[PromptRows]  # hidden-state rows whose logits score prompt tokens (prompt_logprobs)
    # requests verifying proposed tokens: 1 + len(drafts) logits rows each, after the sampling rows, in order
    spec: list[SpecRows] = field(default_factory=list)
    # KV eviction by score: request index in the step -> its trailing query rows whose attention mass is wanted
    scored: dict[int, int] = field(default_factory=dict)
    req_ids: list[str] = field(default_factory=list)  # request ids in step order (attention metadata rows)
    pool_rows: list[PoolRows] = field(default_factory=list)  # pooling requests' rows (runner.pooler)
    token_type_ids: torch.Tensor | None = None  # [T] segments, for a model that embeds them (an encoder)


@dataclass
class SpecRows:
    """A request that verifies ``drafts`` this step: its 1 + len(drafts) logits rows predict the token after its
    last one and after each proposal."""

    state: RequestState
    drafts: list[int]


@dataclass
class PromptRows:
    """Rows [row, row + count) of a step's hidden states predict prompt tokens [start, start + count) of state."""

    state: RequestState
    row: int
    start: int
    count: int


class InputBatch:
    """Holds every live request's state; ``update`` applies a SchedulerOutput, ``prepare`` flattens it."""

    def __init__(self, block_size: int, device: torch.device | str = "cpu", max_position: int | None = None,
                 structured=None, token_types: bool = False, null_block_id: int | None = None) -> None:
        self.block_size = block_size
        self.null_block_id = null_block_id  # the zeroed block given-back entries point at (core.sliding_window)
        self.token_types = token_types  # build each step's token type ids (a model with segment embeddings)
        self.structured = structured  # conveyor.structured.StructuredOutputs: matchers for constrained requests
        self.device = torch.device(device)
        self.max_position = max_position
        self.requests: dict[str, RequestState] = {}
        self.block_table = np.zeros((INITIAL_TABLE_ROWS, INITIAL_TABLE_COLS), dtype=np.int64)
        self.free_rows = list(range(INITIAL_TABLE_ROWS - 1, -1, -1))

    def _ensure_capacity(self, rows: int, cols: int) -> None:
        r, c = self.block_table.shape
        if rows <= r and cols <= c:
            return
        new_r = r if rows <= r else max(rows, 2 * r)
        new_c = c if cols <= c else max(cols, 2 * c)
        grown = np.zeros((new_r, new_c), dtype=np.int64)
        grown[:r, :c] = self.block_table
        self.free_rows.extend(range(grown.shape[0] - 1, r - 1, -1))
        self.block_table = grown

    def _set_blocks(self, state: RequestState, new_block_ids: list[int]) -> None:
        end = state.num_blocks + len(new_block_ids)
        self._ensure_capacity(0, end)
        self.block_table[state.row, state.num_blocks:end] = new_block_ids
        state.num_blocks = end

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(params.seed)

    def update(self, so: SchedulerOutput) -> None:
        """Forget finished / preempted requests, admit new ones, apply the cached ones' deltas."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.free_rows.append(state.row)
        for new in so.scheduled_new_reqs:
            if new.request_id in self.requests:  # re-sent without a preempted notice: replace
                self.free_rows.append(self.requests.pop(new.request_id).row)
            if not self.free_rows:
                self._ensure_capacity(self.block_table.shape[0] + 1, 0)
            gen, error, matcher = None, None, None
            try:
                gen = self._generator(new.sampling_params)
            except Exception as exc:  # noqa: BLE001 - one request's bad seed must not stop the step
                error = f"could not seed its sampling generator: {exc!r}"
            spec = new.sampling_params.structured_outputs
            if spec is not None and error is None:
                try:  # after a preemption the tokens so far are replayed into a fresh matcher
                    matcher = self.structured.matcher(spec, list(new.token_ids[new.num_prompt_tokens:]))
                except Exception as exc:  # noqa: BLE001 - one request's grammar must not stop the step
                    error = f"could not set up its structured output: {exc}"
            state = RequestState(new.request_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                                 new.num_computed_tokens, self.free_rows.pop(), 0, gen, error, matcher)
            self._set_blocks(state, new.block_ids)
            self.requests[new.request_id] = state
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.num_kept_blocks is not None:  # blocks past these went back to the pool
                state.num_blocks = cached.num_kept_blocks
            if cached.evicted_block_indices:  # blocks from the middle of its table went back to the pool
                self._drop_blocks(state, cached.evicted_block_indices)
            state.num_evicted_tokens = cached.num_evicted_tokens
            if cached.num_skipped_blocks > state.num_skipped_blocks:  # outside every window: back in the pool,
                # maybe another request's K/V now; the null block reads as zeros, which the masks then drop
                assert self.null_block_id is not None, "blocks given back outside a window without a null block"
                self.block_table[state.row, state.num_skipped_blocks:cached.num_skipped_blocks] = self.null_block_id
                state.num_skipped_blocks = cached.num_skipped_blocks
            if cached.new_block_ids:
                self._set_blocks(state, cached.new_block_ids)

    def _drop_blocks(self, state: RequestState, indices: list[int]) -> None:
        row = self.block_table[state.row]
        kept = np.delete(row[:state.num_blocks], indices)
        row[:len(kept)] = kept
        state.num_blocks = len(kept)

    def prepare(self, so: SchedulerOutput) -> StepInputs:
        """Flatten the step: decodes first (shortest context first, for the attention buckets), then the rest."""
        scheduled = so.num_scheduled_tokens
        states = [self.requests[r.request_id] for r in so.scheduled_new_reqs]
        states += [self.requests[r.request_id] for r in so.scheduled_cached_reqs]
        decodes = sorted((s for s in states if is_decode(scheduled[s.req_id])), key=lambda s: s.num_computed_tokens)
        others = [s for s in states if not is_decode(scheduled[s.req_id])]
        ordered = decodes + others

        def column(values) -> np.ndarray:
            return np.fromiter(values, dtype=np.int64, count=len(ordered))

        num_new = column(scheduled[s.req_id] for s in ordered)
        computed = column(s.num_computed_tokens for s in ordered)
        flat = flatten(self.block_table, column(s.row for s in ordered), computed, num_new, self.block_size,
                       self.device, evicted=column(s.num_evicted_tokens for s in ordered))  # decodes first
        query_start, positions, seq_lens, num_tokens = flat.query_start, flat.positions, flat.seq_lens, flat.num_tokens

        spec_tokens = so.scheduled_spec_tokens
        input_ids: list[int] = []
        for s, c, n in zip(ordered, computed.tolist(), num_new.tolist()):
            input_ids += s.token_ids[c:c + n]
            if s.req_id in spec_tokens:  # its proposals follow its last token; they are not its tokens yet
                input_ids += spec_tokens[s.req_id]
        if len(input_ids) != num_tokens:  # a step the runner's tokens cannot fill would write K/V out of bounds
            raise ValueError(f"the step schedules {num_tokens} tokens but its requests hold {len(input_ids)}")
        padding = None
        if so.num_padding_tokens:
            padding = self._padding(so.num_padding_tokens, int(num_new.max()) if len(ordered) else 0)
            input_ids += [0] * padding.num_tokens  # pad token id 0; positions restart at 0 in each segment
            positions = np.concatenate([positions, np.arange(padding.num_tokens) % max(padding.segment, 1)])
        pad = padding.num_tokens if padding else 0

        sampling_idx = [i for i, s in enumerate(ordered) if int(seq_lens[i]) == len(s.token_ids)
                        and s.params.pooling is None]
        pool_rows = [PoolRows(s.req_id, s.params.pooling, int(query_start[i]), int(computed[i]), int(num_new[i]),
                              int(seq_lens[i]) >= s.num_prompt_tokens)
                     for i, s in enumerate(ordered) if s.params.pooling is not None]
        prompt_rows = []
        for i, s in enumerate(ordered):
            if s.params.prompt_logprobs is None:
                continue
            # position p predicts token p + 1; prompt tokens 1 .. num_prompt - 1 have a prediction
            c, end = int(computed[i]), min(int(seq_lens[i]), s.num_prompt_tokens - 1)
            if end > c:
                prompt_rows.append(PromptRows(s, int(query_start[i]), c + 1, end - c))
        sampling = [ordered[i] for i in sampling_idx]
        logits_rows = query_start[1:][sampling_idx] - 1
        spec: list[SpecRows] = []
        if spec_tokens:  # every row of a verifying request predicts a token: after the sampling rows, in order
            rows_of = [logits_rows]
            for i, s in enumerate(ordered):
                if s.req_id in spec_tokens:
                    spec.append(SpecRows(s, spec_tokens[s.req_id]))
                    rows_of.append(np.arange(query_start[i], query_start[i + 1]))
            logits_rows = np.concatenate(rows_of)
        logits_indices = None
        if not np.array_equal(logits_rows, np.arange(num_tokens + pad)):  # else every row, in order
            logits_indices = torch.from_numpy(logits_rows).to(self.device)
        dev = self.device
        scored = {i: so.kv_score_rows[s.req_id] for i, s in enumerate(ordered) if s.req_id in so.kv_score_rows} \
            if so.kv_score_rows else {}
        token_types = None
        if self.token_types:  # segment 1 from a pair's second text on (PoolingParams.pair_start)
            starts = column((s.params.pooling.pair_start if s.params.pooling is not None
                             and s.params.pooling.pair_start is not None else len(s.token_ids)) for s in ordered)
            token_types = torch.from_numpy(positions[:num_tokens] >= np.repeat(starts, num_new)).to(dev, torch.int64)
        return StepInputs(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                          torch.from_numpy(positions).to(dev), flat.meta, padding, logits_indices, sampling,
                          SamplingMetadata.build(sampling, dev), prompt_rows, spec, scored,
                          [s.req_id for s in ordered], pool_rows, token_types)

    def _padding(self, num_pad_tokens: int, longest_chunk: int) -> Padding:
        """Pad rows form sequences no longer than the step's longest chunk: the rows a padded [batch, longest]
        tensor would hold (and no longer than the model's positions reach)."""
        segment = longest_chunk or num_pad_tokens
        if self.max_position is not None:
            segment = min(segment, self.max_position)
        return Padding(num_pad_tokens, segment)
