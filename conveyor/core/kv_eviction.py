"""KV eviction policies (``--kv-eviction``): which whole blocks of a request's block table to give back to the pool
when its KV outgrows its budget (``--kv-budget-tokens``, or ``SamplingParams.kv_budget_tokens``).

Why whole blocks from the middle of the table, and not compaction: a freed block goes straight back to the pool
(that is what raises concurrency) with no KV copied, and the block table already maps a request's KV slots to
blocks, so dropping entries from it is all the attention kernels need to see fewer keys. The price is
granularity: a policy keeps or drops ``block_size`` tokens together, scored by their summed attention.

A request's table under eviction (block_size 4, 2 blocks evicted; positions stay the original ones)::

    positions:  0..3 | 4..7   8..11 | 12..15 | 16..19 | 20 21 .  .
    table:     [ s   |  (evicted)   |   h    |   r    |  tail     ]     s sink, h kept (heavy), r recent
    KV slots:   0..3                  4..7     8..11    12 13           slot = position - num_evicted_tokens
                                                                        for every token written from now on

Positions (RoPE) are never renumbered: a new token's position is its index in the request; only its KV slot is
``position - request.num_evicted_tokens`` (new tokens always go after the kept blocks, so one offset per request
says where). Budgets are in blocks: ``B = budget_tokens // block_size``; a request under sink or h2o holds at most
``B + 1`` blocks after any step (``budget + block_size`` tokens), except for blocks it shares with another request
through the prefix cache: those are never evicted (dropping a shared block would free nothing, and its KV is
another request's too), so they count against the budget and may push it over.

Policies:

- ``sink`` (StreamingLLM): the first ``sink_tokens`` tokens' blocks plus the most recent ones; no scores.
- ``h2o`` (Heavy-Hitter Oracle): sink blocks, a protected recent window of half the rest, and of the older
  blocks those with the most attention mass (the runner returns a step's mass per block, summed over heads,
  layers and the step's queries, for every prompt chunk and every ``score_period``-th decode). Ranked by
  ``h2o_rank``: ``mean`` (the default) divides a block's accumulated mass by the scored queries that could see
  it; ``sum`` is the paper's accumulated mass, which favours old blocks only because more queries have seen
  them (on SmolLM2 at a 25% budget: streaming perplexity +12.2% over exact with ``sum``, measured in
  docs/kv-eviction.md against ``mean``).
- ``snapkv``: the prompt is prefilled exactly; right after it, the prompt's blocks are scored by the attention
  of its last ``snapkv_window`` tokens and the lowest scored are dropped down to the budget (the window's blocks
  kept); generation then runs exactly, so the KV grows by the output from there.

This module decides; ``KVCacheManager.evict_blocks`` gives the blocks back and the scheduler tells the runner.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.core.block_pool import KVBlock, cdiv
from conveyor.core.outputs import SchedulerOutput
from conveyor.core.request import Request

if TYPE_CHECKING:
    from conveyor.core.interfaces import KVManager

KV_EVICTION_POLICIES = ("none", "sink", "h2o", "snapkv")
SCORED_POLICIES = ("h2o", "snapkv")  # the runner returns attention mass for these
SINK_TOKENS = 4  # StreamingLLM keeps four initial tokens: the attention sink
SNAPKV_WINDOW = 32  # SnapKV's observation window: the last prompt tokens whose attention scores the rest
# h2o scores a decode every this many of its steps (prompt chunks always). Every step, as H2O: the native kernels
# keep the probabilities their softmax computes anyway, a few percent of a step (docs/kv-eviction.md). On the
# torch backends the side pass costs about the step's attention again; a larger period samples the steps there
# (a decode evicts at most once per block_size steps and its accumulated mass moves slowly).
H2O_SCORE_PERIOD = 1
H2O_RANKS = ("mean", "sum")
# h2o scores at most this many of a prompt chunk's rows, its last ones. A chunk's scored rows get an exact
# softmax of their own after the step (a second QK product, rows x kept keys): scoring every row of chunks of a
# few hundred tokens cost more than a quarter of a long-context trace's time; the last rows of each chunk sample its attention as the decode period samples steps,
# and mean ranking divides each block's mass by the rows that could see it, so sampled and full rows rank alike.
H2O_CHUNK_SCORE_ROWS = 32


@dataclass(frozen=True)
class EvictionConfig:
    """The engine's eviction policy and its default per-request budget (None: only requests that set
    ``SamplingParams.kv_budget_tokens`` are evicted from)."""

    policy: str = "none"
    budget_tokens: int | None = None
    sink_tokens: int = SINK_TOKENS
    snapkv_window: int = SNAPKV_WINDOW
    score_period: int = H2O_SCORE_PERIOD  # h2o: score a decode every this many steps (1: every step, as H2O)
    h2o_rank: str = "mean"  # h2o: rank blocks by mass per query that saw them (mean) or accumulated mass (sum)

    def __post_init__(self) -> None:
        if self.h2o_rank not in H2O_RANKS:
            raise ValueError(f"kv_h2o_rank must be one of {', '.join(H2O_RANKS)}, got {self.h2o_rank!r}")
        if not isinstance(self.score_period, int) or self.score_period < 1:
            raise ValueError(f"kv_score_period must be an integer >= 1, got {self.score_period!r}")
        if self.policy not in KV_EVICTION_POLICIES:
            raise ValueError(f"kv_eviction must be one of {', '.join(KV_EVICTION_POLICIES)}, got {self.policy!r}")
        if self.budget_tokens is not None and (not isinstance(self.budget_tokens, int) or self.budget_tokens < 1):
            raise ValueError(f"kv_budget_tokens must be an integer >= 1, got {self.budget_tokens!r}")
        if self.policy == "none" and self.budget_tokens is not None:
            raise ValueError("kv_budget_tokens needs an eviction policy: set --kv-eviction sink, h2o or snapkv")

    @property
    def enabled(self) -> bool:
        return self.policy != "none"


@dataclass
class _RequestScores:
    blocks: list[float] = field(default_factory=list)  # accumulated mass per block, in block-table order
    exposure: list[float] = field(default_factory=list)  # scored query rows that could see each block
    compressed: bool = False  # snapkv: the prompt was compressed already (generation now runs exactly)
    shared: int = 0  # blocks of its table shared with another request at the last choice: over budget by these


class KVEvictor:
    """Per-request eviction decisions over block tables, and the score buffers they read. Pure bookkeeping: it
    never changes a table itself (the scheduler applies its choice through the KV manager)."""

    def __init__(self, config: EvictionConfig, block_size: int) -> None:
        assert config.enabled
        self.config = config
        self.block_size = block_size
        self.sink_blocks = 0 if config.policy == "snapkv" else cdiv(config.sink_tokens, block_size)
        self._state: dict[str, _RequestScores] = {}

    # ---- budgets ------------------------------------------------------------------------------------------
    def budget_blocks(self, request: Request) -> int | None:
        """The request's budget in blocks, or None when it is not evicted from. A budget too small to hold the
        sink, one window block and one chunk block is raised to that (sink + 2 blocks)."""
        tokens = request.sampling_params.kv_budget_tokens
        if tokens is None:
            tokens = self.config.budget_tokens
        if tokens is None:
            return None
        return max(tokens // self.block_size, self.sink_blocks + 2)

    def _chunk_blocks(self, budget: int) -> int:
        # A prompt under sink / h2o is prefilled a quarter of its budget at a time, so the chunk's queries still
        # see most of the budget's keys (a chunk as large as the budget would see only itself and the sinks).
        return max(1, budget // 4)

    def chunk_cap(self, request: Request) -> int | None:
        """Most prompt tokens one step may compute for this request (None: no cap). Only sink and h2o cap:
        snapkv prefills exactly, whatever the prompt's length."""
        budget = self.budget_blocks(request)
        if budget is None or self.config.policy == "snapkv":
            return None
        return self._chunk_blocks(budget) * self.block_size

    def max_hit_blocks(self, request: Request) -> int | None:
        """Most prefix-cache hit blocks an admission may take, so that hit + first chunk fit the budget."""
        budget = self.budget_blocks(request)
        if budget is None or self.config.policy == "snapkv":
            return None
        return budget - self._chunk_blocks(budget)

    def fit_hit(self, request: Request, blocks: Sequence[KVBlock], num_tokens: int) -> tuple[Sequence[KVBlock], int]:
        """A prefix-cache hit (blocks, tokens) cut to ``max_hit_blocks``."""
        most = self.max_hit_blocks(request)
        if most is None or len(blocks) <= most:
            return blocks, num_tokens
        return blocks[:most], most * self.block_size

    # ---- the decision -------------------------------------------------------------------------------------
    def choose(self, request: Request, blocks: Sequence[KVBlock], num_new: int) -> list[int]:
        """Block-table indices (ascending) to evict before ``num_new`` more tokens of ``request`` are allocated.

        Only full, computed blocks held by this request alone (ref count 1) are candidates; sink blocks never
        are. Evicts just enough for the request to hold at most budget + 1 blocks after the allocation (or, for
        snapkv, once, right after its prompt), fewer when the candidates run out."""
        budget = self.budget_blocks(request)
        if budget is None:
            return []
        bs = self.block_size
        present = request.num_computed_tokens - request.num_evicted_tokens
        excess = cdiv(present + num_new, bs) - (budget + 1)
        policy = self.config.policy
        if policy == "snapkv":
            state = self._state.setdefault(request.request_id, _RequestScores())
            if state.compressed or request.num_computed_tokens < request.num_prompt_tokens:
                return []
            state.compressed = True  # once: from here on it generates exactly
            # keep the blocks of the observation window (the last window of the prompt) whole
            window_start = request.num_prompt_tokens - self.config.snapkv_window - request.num_evicted_tokens
            protected_from = max(0, window_start) // bs
        elif policy == "h2o":
            window = budget - self.sink_blocks - self._chunk_blocks(budget)
            protected_from = present // bs - max(1, window // 2)  # the recent half of the window stays
        else:  # sink: the oldest non-sink blocks go first, which keeps the recent ones
            protected_from = present // bs
        if policy != "snapkv":
            self._state.setdefault(request.request_id, _RequestScores()).shared = \
                sum(1 for b in blocks if b.ref_cnt > 1)
        if excess <= 0:
            return []
        candidates = [i for i in range(self.sink_blocks, min(protected_from, present // bs))
                      if blocks[i].ref_cnt == 1]
        if policy != "sink":
            scores = self._rank_scores(request.request_id, policy)
            # lowest mass first; among equals the older block (fewer queries have seen the newer ones)
            candidates.sort(key=lambda i: (scores[i] if i < len(scores) else 0.0, i))
        return sorted(candidates[:excess])

    def score_rows(self, request: Request, num_new: int) -> int:
        """How many of this step's last query rows of ``request`` the runner should score (0: none).

        h2o: a prompt chunk's last ``H2O_CHUNK_SCORE_ROWS`` rows; a decode's row every ``score_period`` steps.
        snapkv: the rows among the prompt's last ``snapkv_window`` tokens, before its compression."""
        if self.config.policy not in SCORED_POLICIES or self.budget_blocks(request) is None:
            return 0
        if self.config.policy == "h2o":
            if num_new == 1 and request.num_computed_tokens % self.config.score_period:
                return 0  # a decode between samples (see H2O_SCORE_PERIOD)
            return min(num_new, H2O_CHUNK_SCORE_ROWS)
        state = self._state.get(request.request_id)
        if state is not None and state.compressed:
            return 0
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        window_start = request.num_prompt_tokens - self.config.snapkv_window
        # rows [start, end) of positions; the scored ones are [max(start, window_start), min(end, prompt)),
        # and they must be the step's last rows (a step's rows past the prompt, if any, are not scored)
        if end > request.num_prompt_tokens or end <= window_start:
            return 0
        return end - max(start, window_start)

    def _rank_scores(self, request_id: str, policy: str) -> list[float]:
        state = self._state.get(request_id, _RequestScores())
        if policy == "snapkv" or self.config.h2o_rank == "sum":
            return state.blocks
        # a block no scored query has seen yet ranks above every other: nothing says it is light
        return [m / e if e > 0 else float("inf") for m, e in zip(state.blocks, state.exposure)]

    # ---- score buffers ------------------------------------------------------------------------------------
    def add_step_scores(self, requests: Mapping[str, Request], out: SchedulerOutput,
                        block_scores: dict[str, list[float]]) -> None:
        """A step's attention mass per block of the requests it scored (``ModelOutput.kv_block_scores``), before
        the scheduler advances their computed counts: their scored rows are the step's last ones."""
        for rid, scores in block_scores.items():
            request = requests.get(rid)
            if request is not None and request.status.holds_slot:
                end = request.num_computed_tokens + out.num_scheduled_tokens.get(rid, 0) - request.num_evicted_tokens
                rows = out.kv_score_rows.get(rid, 0)
                self.add_scores(rid, scores, (end - rows, end))

    def add_scores(self, request_id: str, block_scores: list[float], scored_slots: tuple[int, int]) -> None:
        """Accumulate one step's attention mass per block (block-table order, as the runner saw the table).

        ``scored_slots`` = (first, end): the KV slots of the step's scored query rows. Block ``i`` (slots
        ``i * block_size ..``) was visible to the rows at slots at or past its start, which is its exposure:
        what ``h2o_rank`` ``mean`` divides its mass by."""
        state = self._state.setdefault(request_id, _RequestScores())
        acc, exposure = state.blocks, state.exposure
        if len(acc) < len(block_scores):
            acc.extend([0.0] * (len(block_scores) - len(acc)))
            exposure.extend([0.0] * (len(block_scores) - len(exposure)))
        first, end = scored_slots
        for i, s in enumerate(block_scores):
            acc[i] += s
            exposure[i] += max(0, end - max(first, i * self.block_size))

    def on_evicted(self, request_id: str, indices: list[int]) -> None:
        """Keep the score buffer aligned with the table after ``indices`` were dropped from it."""
        state = self._state.get(request_id)
        if state is not None and state.blocks:
            gone = set(indices)
            state.blocks = [s for i, s in enumerate(state.blocks) if i not in gone]
            state.exposure = [e for i, e in enumerate(state.exposure) if i not in gone]

    def forget(self, request_id: str) -> None:
        """The request's KV is gone (finished, or preempted: recomputed exactly later)."""
        self._state.pop(request_id, None)

    def over_budget_allowance(self, request_id: str) -> int:
        """How many blocks over budget + 1 the request may hold: the shared blocks it could not evict."""
        state = self._state.get(request_id)
        return state.shared if state is not None else 0

    def check_invariants(self, kv: KVManager, requests: Iterable[Request], running: Iterable[Request]) -> None:
        """Eviction's own invariants over the scheduler's requests and the paged ``kv`` manager: evicted counts in
        whole blocks and only in running requests; every table holds exactly its present tokens' blocks; sink and
        h2o requests within budget + 1 blocks but for the shared ones they could not evict."""
        bs = self.block_size
        running_ids = {r.request_id for r in running}
        for request in requests:
            rid = request.request_id
            if rid not in running_ids:
                assert request.num_evicted_tokens == 0, f"{rid} holds no KV but counts evictions"
                continue
            assert request.num_evicted_tokens % bs == 0, "evicted tokens are whole blocks"
            blocks = kv.blocks_of(rid)
            present = request.num_computed_tokens - request.num_evicted_tokens
            assert len(blocks) == cdiv(present, bs), f"{rid}: {len(blocks)} blocks for {present} tokens"
            budget = self.budget_blocks(request)
            if budget is not None and self.config.policy != "snapkv":
                # shared blocks are never evicted: those held at its last eviction choice may keep it over
                allowance = max(self.over_budget_allowance(rid), sum(1 for b in blocks if b.ref_cnt > 1))
                assert len(blocks) <= budget + 1 + allowance, f"{rid}: {len(blocks)} blocks, budget {budget}"

    def scores(self, request_id: str) -> list[float]:
        state = self._state.get(request_id)
        return list(state.blocks) if state is not None else []
