"""Scenario helpers for core tests: build a scheduler and requests, and a fake executor (no model, no torch)."""

from __future__ import annotations

import random

from conveyor.core import ModelOutput, Request, SamplingParams, Scheduler, SchedulerConfig, SchedulerOutput
from conveyor.core.outputs import CachedRequestData
from conveyor.core.kv_manager import KVCacheManager

EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = 4, enable_prefix_caching: bool = True,
                   prefix_cache_eviction: str = "lru", sliding_window: int = 0, **overrides):
    config = SchedulerConfig(**{"max_model_len": 1024, "max_num_batched_tokens": 64, **overrides})
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching, prefix_cache_eviction,
                                            sliding_window=sliding_window))


def make_request(rid: str, prompt_len: int = 8, max_tokens: int = 4, first_token: int = 10, **params) -> Request:
    prompt = list(range(first_token, first_token + prompt_len))
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=params.pop("ignore_eos", True), **params)
    return Request(rid, prompt, sp, eos_token_ids=(EOS,), max_model_len=1024)


def make_requests(n: int, prompt_len: int = 8, max_tokens: int = 4, **kw) -> list[Request]:
    return [make_request(f"r{i}", prompt_len, max_tokens, first_token=100 * i + 10, **kw) for i in range(n)]


class FakeExecutor:
    """Mirrors the runner's per-request state so it knows who samples; samples a deterministic token."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.rng = rng

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tokens.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.request_id not in self.tokens, "executor told twice about a request"
            self.tokens[new.request_id] = list(new.token_ids)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            toks = self.tokens[rid]
            start = next((r.num_computed_tokens for r in out.scheduled_new_reqs if r.request_id == rid), None)
            if start is None:
                start = next(r.num_computed_tokens for r in out.scheduled_cached_reqs if r.request_id == rid)
            assert start + n <= len(toks), f"{rid}: scheduled past its tokens"
            if start + n == len(toks):
                token = self.rng.randrange(5, 50) if self.rng else 7
                toks.append(token)
                sampled[rid] = token
        return ModelOutput(sampled_token_ids=sampled)


def step(scheduler: Scheduler, executor: FakeExecutor, now: float = 0.0):
    out = scheduler.schedule(now)
    updates = scheduler.update(out, executor.execute(out), now)
    return out, updates


def mirror_table(table: list[int], delta: CachedRequestData, null_block_id: int | None = None) -> None:
    """Apply a cached request's block-table delta to ``table`` as the runner applies it (``InputBatch.update``)."""
    if delta.num_kept_blocks is not None:
        del table[delta.num_kept_blocks:]
    if delta.evicted_block_indices:
        gone = set(delta.evicted_block_indices)
        table[:] = [b for i, b in enumerate(table) if i not in gone]
    if delta.num_skipped_blocks:
        assert null_block_id is not None, "entries given back outside a window without a null block"
        table[:delta.num_skipped_blocks] = [null_block_id] * delta.num_skipped_blocks
    table.extend(delta.new_block_ids)


class TableMirror(FakeExecutor):
    """A fake executor that keeps each request's block table from the scheduler's messages alone, as the runner
    does, and returns attention scores (a deterministic function of the block and the step) when asked."""

    def __init__(self, rng: random.Random | None = None, null_block_id: int | None = None) -> None:
        super().__init__(rng)
        self.null_block_id = null_block_id
        self.tables: dict[str, list[int]] = {}
        self.evicted: dict[str, int] = {}
        self.scored_steps = 0

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(rid, None)
            self.evicted.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tables[new.request_id] = list(new.block_ids)
            self.evicted[new.request_id] = 0
        for c in out.scheduled_cached_reqs:
            mirror_table(self.tables[c.request_id], c, self.null_block_id)
            self.evicted[c.request_id] = c.num_evicted_tokens
        mo = super().execute(out)
        for rid, rows in out.kv_score_rows.items():
            assert 0 < rows <= out.num_scheduled_tokens[rid]
            self.scored_steps += 1
            table = self.tables[rid]
            # a block's "attention" depends on its id: the same block keeps its rank across steps
            mo.kv_block_scores[rid] = [rows * ((b * 7919) % 13) / 13.0 for b in table]
        return mo
