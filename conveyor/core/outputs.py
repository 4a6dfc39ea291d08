"""The plain-data contract between the scheduler and an executor (the real model runner, the simulator, a fake).

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

from conveyor.core.sampling_params import SamplingParams


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
    # Baseline policies only: extra pad tokens the executor must really compute (static batching pads every
    # prompt of a batch to the longest one). They attend to nothing useful and their results are dropped.
    num_padding_tokens: int = 0
    # Of the scheduled tokens, how many are "idle-slot" work (a finished request kept decoding by a static
    # batch): computed for real, output discarded. Counted as wasted by the benchmark.
    num_idle_slot_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0 and self.num_padding_tokens == 0

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled_new_reqs) + len(self.scheduled_cached_reqs)


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
    """What the executor returns for one ``SchedulerOutput``: one sampled token per request that sampled."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # only for requests that asked
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # only for requests that asked
