"""The plain-data contract between the scheduler and an executor (the torch model runner, a test's fake, any cost model).

One step is ``schedule(now) -> SchedulerOutput``, ``executor.execute(SchedulerOutput) -> ModelOutput``,
``scheduler.update(SchedulerOutput, ModelOutput, now)``. Everything here is ids and ints, so the same object can be
fed to a torch runner, a cost model, or a test.

The executor keeps per-request state across steps (token ids, block table, sampling params), as vLLM v1's
runner does: a request is sent whole once (``NewRequestData``: when first scheduled, and again after a
recompute preemption, then carrying prompt + tokens generated so far) and afterwards only as deltas
(``CachedRequestData``). Tokens the executor samples it appends to its own copy; the scheduler never echoes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from conveyor.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conveyor.core.request import Request, StopDecision


@dataclass(slots=True)
class NewRequestData:
    """A request the executor has not seen (or has forgotten after a preemption)."""

    request_id: str
    token_ids: list[int]  # prompt + outputs generated before a preemption: everything to (re)compute
    num_prompt_tokens: int  # the first num_prompt_tokens of token_ids are the prompt (penalties need the split)
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table (for the slab layout: the reserved slab's blocks)
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hit); 0 otherwise


@dataclass(slots=True)
class CachedRequestData:
    """A request the executor already holds: only what changed."""

    request_id: str
    new_block_ids: list[int]  # appended to its block table
    num_computed_tokens: int  # before this step
    # Set when the request gave blocks back since its last step (rejected proposals' blocks): its block table
    # keeps this many, then new_block_ids follow. None: nothing given back.
    num_kept_blocks: int | None = None
    # KV eviction (core.kv_eviction): indices of its block table dropped before this step (applied after
    # num_kept_blocks, before new_block_ids are appended), and its evicted tokens in all, after them: its KV slot
    # of position p is p - num_evicted_tokens. None / 0: nothing evicted.
    evicted_block_indices: list[int] | None = None
    num_evicted_tokens: int = 0
    # Sliding windows (core.sliding_window): its table's first num_skipped_blocks entries are the null block now
    # (their blocks went back to the pool and may hold another request's K/V); cumulative, 0: none.
    num_skipped_blocks: int = 0


@dataclass
class SchedulerOutput:
    """What to compute in one forward pass.

    ``num_scheduled_tokens[req_id]`` tokens of each listed request are computed, starting at its
    ``num_computed_tokens``. A request samples a token when this step brings its computed tokens up to all the
    tokens the executor holds for it (a prefill's last chunk, or a decode step); otherwise it returns nothing.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Ids the executor should forget before this step: finished or aborted since the last step, or preempted.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Work a policy wastes on purpose (the static/dynamic baselines; ``policies.WastedWork``): pad tokens the
    # executor must really compute (a static batch pads every prompt to the longest one; they attend to nothing
    # useful and their results are dropped), and how many of the scheduled tokens are "idle-slot" work (a
    # parked request kept decoding: computed for real, output discarded). The benchmark counts both as waste.
    num_padding_tokens: int = 0
    num_idle_slot_tokens: int = 0
    # Speculative decoding: a request listed here computes its last token and then these proposed tokens
    # (``num_scheduled_tokens`` counts them all) and returns the run of them the model agrees with
    # (``ModelOutput.extra_token_ids``). The executor never keeps the proposals in its token list. With a draft
    # model the tokens are ``speculative.DRAFT_PLACEHOLDER``s that the executor replaces by its draft's, in place.
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # KV eviction by attention score (h2o, snapkv): the runner returns, for each listed request, the attention
    # mass its last ``kv_score_rows[id]`` query rows of this step put on each block of its table
    # (``ModelOutput.kv_block_scores``). Empty unless such a policy is on: no cost otherwise.
    kv_score_rows: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0 and self.num_padding_tokens == 0

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled_new_reqs) + len(self.scheduled_cached_reqs)


def is_decode(num_new_tokens: int) -> bool:
    """Whether a request's share of a step is a decode: exactly one new token, so one query row.

    The scheduler asks it of the tokens a request is behind (decodes are scheduled first), the runner of the
    tokens scheduled (decodes take the batched attention path). The step metrics add "and past the prompt",
    because there the question is what kind of work a token was: a one-token prompt is prefill work.
    """
    return num_new_tokens == 1


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one sampled token: its own, and the top-N alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # 1 + how many tokens were more likely (set for prompt tokens)


@dataclass
class PromptLogprobs:
    """Logprobs of a run of prompt tokens computed in one step: ``entries[i]`` is prompt token ``start + i``'s
    (``start >= 1``: nothing predicts the first token). A recomputed prompt (preemption) repeats positions."""

    start: int
    entries: list[TokenLogprobs]


@dataclass
class ModelOutput:
    """What the executor returns for one ``SchedulerOutput``: one sampled token per request that sampled, and,
    for a request that verified proposed tokens, the tokens after it (``extra_token_ids``: the accepted
    proposals but the first, then the token sampled after the last accepted one), in order."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    extra_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # only for requests that asked
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # only for requests that asked
    # Requests whose per-request setup failed in the executor (id -> why). Their tokens were still computed
    # (the KV cache stays consistent for blocks they share) but they sampled nothing; the engine fails them.
    failed: dict[str, str] = field(default_factory=dict)
    # For the requests in SchedulerOutput.kv_score_rows: attention mass per block of the table (in table order),
    # summed over heads, layers and the scored query rows.
    kv_block_scores: dict[str, list[float]] = field(default_factory=dict)
    # Pooling requests whose last prompt token this step computed: the embedding, or [score]
    pooled: dict[str, list[float]] = field(default_factory=dict)


class RequestUpdate(msgspec.Struct, array_like=True, gc=False):
    """What one step did to one request: the token it produced and whether that finished it (and why), with the
    request's counters as of this step (the output side reports them; it never reads the ``Request``).

    It is also the wire form of a token between the engine core and the output processor (``engine.ipc``): a
    ``msgspec`` struct (msgspec imports nothing of torch), so the scheduler's own object crosses the process
    boundary without a copy into another type."""

    request_id: str
    new_token_id: int
    logprobs: TokenLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" when this token finished it
    stop_reason: int | None = None  # the stop token id that finished it, if one did
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at its first admission
    num_preemptions: int = 0
    first_scheduled: float | None = None  # when first scheduled (the engine's time.monotonic(), system-wide)
    pooled: list[float] | None = None  # a pooling request's result (new_token_id is then -1)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, request: Request, token: int, logprobs: TokenLogprobs | None, stop: StopDecision | None,
           pooled: list[float] | None = None) -> RequestUpdate:
        """``request``'s update for ``token`` (just appended; -1 for a pooling request's ``pooled`` result), which
        ``stop`` (when not None) finished."""
        return cls(request.request_id, token, logprobs, request.finish_reason if stop is not None else None,
                   stop.stop_reason if stop is not None else None, request.num_cached_prompt_tokens,
                   request.num_preemptions, request.times.first_scheduled, pooled)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """An immutable snapshot of the scheduler and its KV cache, taken between steps (vLLM's ``make_stats``).

    Whoever lives on another thread (the HTTP server's metrics and status line) reads this, never the live
    objects.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks referenced by a request
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens
    # speculative decoding, cumulative (vLLM's spec_decode counters): proposals verified, tokens proposed,
    # tokens accepted, and accepted tokens by their position in the proposal
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    kv_evicted_blocks: int = 0  # cumulative: blocks given back to the pool by KV eviction (core.kv_eviction)
