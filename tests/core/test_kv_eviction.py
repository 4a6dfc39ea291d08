"""KV eviction (core.kv_eviction) in the scheduler: scenarios per policy, refusals, and randomized drives with the
invariants checked after every step, preemption and prefix caching on beside it."""

from __future__ import annotations

import random

import pytest

from conveyor.core import Request, SamplingParams, Scheduler, SchedulerConfig
from conveyor.core.config import CacheConfig
from conveyor.core.kv_eviction import EvictionConfig
from conveyor.core.kv_manager import KVCacheManager
from conveyor.core.slab_manager import SlabKVManager
from tests.helpers.core import FakeExecutor, TableMirror, make_request


def make_evicting(eviction: str = "sink", budget: int | None = 16, num_blocks: int = 64, block_size: int = 4,
                  enable_prefix_caching: bool = True, **overrides) -> Scheduler:
    config = SchedulerConfig(**{"max_model_len": 1024, "max_num_batched_tokens": 64,
                                "eviction": EvictionConfig(eviction, budget), **overrides})
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching))


def drive(s: Scheduler, ex: TableMirror, max_steps: int = 10_000, on_step=None) -> None:
    for t in range(max_steps):
        out = s.schedule(float(t))
        s.update(out, ex.execute(out), float(t))
        s.check_invariants()
        for rid in s.kv.req_blocks:  # (a request finished in this update is forgotten by the next step)
            assert ex.tables[rid] == s.kv.block_ids(rid), f"{rid}: the executor's table drifted from the scheduler's"
        if on_step is not None:
            on_step(out)
        if not s.has_unfinished_requests():
            return
    raise AssertionError("did not finish")


def test_sink_keeps_first_block_and_recent_window_within_budget():
    s = make_evicting("sink", budget=16, block_size=4)  # B = 4 blocks: at most 5 held
    r = make_request("a", prompt_len=8, max_tokens=60)
    s.add_request(r)
    ex = TableMirror()
    first_block = []
    held = []

    def watch(out):
        blocks = s.kv.req_blocks.get("a")
        if blocks:
            first_block.append(blocks[0].block_id)
            held.append(len(blocks))

    drive(s, ex, on_step=watch)
    assert r.num_output_tokens == 60
    assert max(held) <= 5 and len(set(first_block)) == 1  # the sink block never moves
    assert s.kv.num_evicted_blocks > 0
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks


def test_evicted_positions_stay_original_and_slots_shift():
    s = make_evicting("sink", budget=16, block_size=4)
    s.add_request(make_request("a", prompt_len=8, max_tokens=40))
    ex = TableMirror()
    for t in range(30):
        out = s.schedule(float(t))
        s.update(out, ex.execute(out), float(t))
    r = s.requests["a"]
    # the request's computed count is its position (what RoPE sees); its KV slots are fewer by the evicted tokens
    assert r.num_computed_tokens == r.num_tokens - 1 == 8 + r.num_output_tokens - 1
    assert r.num_evicted_tokens > 0 and r.num_evicted_tokens % 4 == 0
    assert len(s.kv.req_blocks["a"]) == -(-(r.num_computed_tokens - r.num_evicted_tokens) // 4)
    assert ex.evicted["a"] == r.num_evicted_tokens


def test_long_prompt_is_chunked_to_fit_the_budget():
    s = make_evicting("sink", budget=32, block_size=4, max_num_batched_tokens=512)  # B = 8, chunks of 2 blocks
    s.add_request(make_request("a", prompt_len=100, max_tokens=2))
    ex = TableMirror()
    chunks = []
    drive(s, ex, on_step=lambda out: chunks.append(out.num_scheduled_tokens.get("a")))
    assert max(c for c in chunks if c) == 8
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks


def test_shared_prefix_blocks_are_never_evicted():
    s = make_evicting("sink", budget=16, block_size=4)
    shared = list(range(100, 112))  # 3 full blocks
    a = Request("a", shared + [1, 2], SamplingParams(max_tokens=50, ignore_eos=True, kv_budget_tokens=1000), (),
                1024)
    b = Request("b", shared + [3, 4], SamplingParams(max_tokens=40, ignore_eos=True), (), 1024)
    s.add_request(a)
    ex = TableMirror()
    out = s.schedule(0.0)
    s.update(out, ex.execute(out), 0.0)
    s.add_request(b)
    shared_ids = s.kv.block_ids("a")[:3]
    seen_shared_in_b = []

    def watch(out):
        if "b" in s.kv.req_blocks and "a" in s.kv.req_blocks:
            seen_shared_in_b.append(all(i in s.kv.block_ids("b") for i in shared_ids))

    drive(s, ex, on_step=watch)
    assert b.num_cached_prompt_tokens == 12  # b took the prefix from the cache
    assert seen_shared_in_b and all(seen_shared_in_b)  # and, while a held it too, b never gave it up
    assert s.kv.num_evicted_blocks > 0


def test_blocks_computed_after_an_eviction_never_enter_the_prefix_cache():
    s = make_evicting("sink", budget=16, block_size=4)
    s.add_request(make_request("a", prompt_len=8, max_tokens=40))
    ex = TableMirror()
    drive(s, ex)
    cached = len(s.kv.pool.cached)
    # exactly the blocks full before the first eviction carry keys: the prompt's 2 and the ones decode filled
    # until the table reached the budget (4 blocks + the block being filled)
    assert cached == 5
    # a second identical request finds the exact prefix, no more
    s.add_request(make_request("b", prompt_len=8, max_tokens=2))
    out = s.schedule(100.0)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4  # the prompt's first block (the last token is computed)


def test_h2o_evicts_the_lowest_scored_old_block_and_keeps_the_recent_ones():
    s = make_evicting("h2o", budget=32, block_size=4)  # B = 8: sink 1, chunk 2, window 5, recent 2
    r = make_request("a", prompt_len=8, max_tokens=80)
    s.add_request(r)
    ex = TableMirror()
    evictions = []

    def watch(out):
        for c in out.scheduled_cached_reqs:
            if c.evicted_block_indices:
                evictions.append(c.evicted_block_indices)

    drive(s, ex, on_step=watch)
    assert ex.scored_steps > 0 and evictions
    for indices in evictions:
        assert all(1 <= i for i in indices)  # never the sink


def test_h2o_choice_follows_scores():
    s = make_evicting("h2o", budget=32, block_size=4, max_num_batched_tokens=8)
    s.add_request(make_request("a", prompt_len=40, max_tokens=3))
    ex = FakeExecutor()
    for t in range(4):  # the prompt in chunks of 8 tokens (B // 4 = 2 blocks): 32 of 40 after 4 steps
        out = s.schedule(float(t))
        mo = ex.execute(out)
        n = len(s.kv.req_blocks["a"])
        # block 3 is the "heavy hitter", the rest get nothing
        mo.kv_block_scores["a"] = [5.0 if i == 3 else 0.0 for i in range(n)]
        s.update(out, mo, float(t))
    ids_before = s.kv.block_ids("a")
    out = s.schedule(5.0)  # 32 tokens in 8 blocks, 8 more: over B + 1 = 9 by one: the lowest old block goes
    evicted = out.scheduled_cached_reqs[0].evicted_block_indices
    assert evicted == [1]  # not the sink (0), not the heavy hitter (3); block 1 is the oldest of the zeros
    assert ids_before[3] in s.kv.block_ids("a")


@pytest.mark.parametrize("rank, evicted_block", [("sum", 3), ("mean", 1)])
def test_h2o_ranks_by_mass_per_query_that_saw_the_block_or_by_accumulated_mass(rank, evicted_block):
    # Each scored row gives block i a mass of rate[i]: block 1 is the lightest per row, but older than block 3,
    # so more rows saw it (28 against 20) and its accumulated mass is the larger (28 against 24).
    rate = {1: 1.0, 2: 3.0, 3: 1.2, 4: 3.0, 5: 3.0}
    config = SchedulerConfig(max_model_len=1024, max_num_batched_tokens=8, eviction=EvictionConfig("h2o", 32,
                                                                                                   h2o_rank=rank))
    s = Scheduler(config, KVCacheManager(64, 4, True))
    s.add_request(make_request("a", prompt_len=40, max_tokens=3))
    ex = FakeExecutor()
    for t in range(4):  # the prompt in chunks of 8 tokens (B // 4 = 2 blocks): 32 of 40 after 4 steps
        out = s.schedule(float(t))
        assert out.kv_score_rows["a"] == 8
        mo = ex.execute(out)
        n = len(s.kv.req_blocks["a"])
        # the rows at slots 8t .. 8t+7 that see block i (slots 4i ..): those at or past its first slot
        mo.kv_block_scores["a"] = [rate.get(i, 0.0) * max(0, 8 * t + 8 - max(8 * t, 4 * i)) for i in range(n)]
        s.update(out, mo, float(t))
    # each chunk's 8 rows saw every whole block before them and part of the ones they filled
    assert s.evictor._state["a"].exposure == [32, 28, 24, 20, 16, 12, 8, 4]
    out = s.schedule(5.0)  # 32 tokens in 8 blocks, 8 more: over B + 1 = 9 by one; blocks 1-5 are candidates
    assert out.scheduled_cached_reqs[0].evicted_block_indices == [evicted_block]


def test_h2o_scores_the_last_rows_of_a_long_chunk_only():
    from conveyor.core.kv_eviction import H2O_CHUNK_SCORE_ROWS

    s = make_evicting("h2o", budget=1024, block_size=4, max_num_batched_tokens=256)  # chunks of 256 tokens
    s.add_request(make_request("a", prompt_len=300, max_tokens=2))
    s.add_request(make_request("b", prompt_len=20, max_tokens=2))
    out = s.schedule(0.0)
    assert out.num_scheduled_tokens["a"] > H2O_CHUNK_SCORE_ROWS
    assert out.kv_score_rows == {"a": H2O_CHUNK_SCORE_ROWS} | (
        {"b": out.num_scheduled_tokens["b"]} if "b" in out.num_scheduled_tokens else {})


def test_snapkv_compresses_once_after_the_prompt_then_generates_exactly():
    s = make_evicting("snapkv", budget=32, block_size=4, max_num_batched_tokens=256)
    s.add_request(make_request("a", prompt_len=100, max_tokens=30))
    ex = TableMirror()
    held = []
    drive(s, ex, on_step=lambda out: held.append(len(s.kv.req_blocks.get("a", []))))
    # prefill held the whole prompt (25 blocks), then the prompt went down to B + 1 = 9 blocks and grew by the output
    assert held[0] == 25
    assert held[1] == 9
    assert s.kv.num_evicted_blocks == 17  # 25 prompt blocks + 1 for the first decode, down to 9, once
    assert held[1:-1] == sorted(held[1:-1])  # then only growth: the output is generated exactly
    assert held[-2] == -(-(100 + 28 - 17 * 4) // 4)  # the last step computed output token 28
    assert ex.scored_steps == 1  # the prefill's last 32 rows, once


def test_refusals():
    with pytest.raises(ValueError, match="paged"):
        Scheduler(SchedulerConfig(max_model_len=64, eviction=EvictionConfig("sink", 16)), SlabKVManager(64, 4, 64))
    with pytest.raises(ValueError, match="continuous or chunked"):
        SchedulerConfig(policy="static", max_model_len=64, eviction=EvictionConfig("sink", 16))
    with pytest.raises(ValueError, match="speculative"):
        SchedulerConfig(max_model_len=64, speculative_config={"method": "ngram"}, eviction=EvictionConfig("h2o", 16))
    with pytest.raises(ValueError, match="needs an eviction policy"):
        EvictionConfig("none", 16)
    with pytest.raises(ValueError, match="kv_eviction must be one of"):
        EvictionConfig("lru")
    with pytest.raises(ValueError, match="paged"):
        CacheConfig(kv_layout="slab", kv_eviction="sink")
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        SamplingParams(kv_budget_tokens=0)


def test_no_budget_no_eviction():
    s = make_evicting("sink", budget=None)  # only requests that set a budget are evicted from
    s.add_request(make_request("a", prompt_len=8, max_tokens=60))
    s.add_request(make_request("b", prompt_len=8, max_tokens=60, kv_budget_tokens=16, first_token=300))
    drive(s, TableMirror())
    assert s.kv.num_evicted_blocks > 0
    assert s.requests == {}


@pytest.mark.parametrize("policy", ["sink", "h2o", "snapkv"])
@pytest.mark.parametrize("seed", range(4))
def test_random_drive_with_eviction(policy, seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    s = make_evicting(
        policy, budget=rng.choice([None, 8, 24, 64]), num_blocks=rng.randint(40, 120) // block_size * 4 + 40,
        block_size=block_size, policy=rng.choice(["continuous", "chunked"]), max_num_seqs=rng.randint(1, 12),
        max_num_batched_tokens=rng.choice([8, 32, 128]), max_model_len=200,
        enable_prefix_caching=rng.random() < 0.7)
    ex = TableMirror(rng)
    shared = [rng.randrange(5, 50) for _ in range(48)]
    pending = []
    for i in range(rng.randint(10, 30)):
        prompt = (shared[:rng.randint(0, 48)] if rng.random() < 0.6 else []) + \
            [rng.randrange(5, 50) for _ in range(rng.randint(1, 60))]
        budget = rng.choice([None, None, 12, 40])
        pending.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 60), ignore_eos=True,
                                                               kv_budget_tokens=budget), (2,), 200))
    reqs = list(pending)
    from conveyor.core import RequestStatus

    for t in range(20_000):
        if pending and rng.random() < 0.3:
            s.add_request(pending.pop(0))
        if rng.random() < 0.02 and s.running:
            s.finish_request(rng.choice(s.running).request_id, RequestStatus.FINISHED_ABORTED, t)
        out = s.schedule(float(t))
        s.update(out, ex.execute(out), float(t))
        s.check_invariants()
        for rid in s.kv.req_blocks:
            assert ex.tables[rid] == s.kv.block_ids(rid)
        if not pending and not s.has_unfinished_requests():
            break
    assert all(r.is_finished for r in reqs)
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks
    for r in reqs:
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.sampling_params.max_tokens


def test_thousand_requests_leak_nothing_under_pressure():
    rng = random.Random(7)
    s = make_evicting("h2o", budget=16, num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                      max_model_len=200)
    ex = TableMirror(rng)
    shared = [rng.randrange(5, 50) for _ in range(24)]
    for i in range(1000):
        prompt = shared[:rng.randint(0, 24)] + [rng.randrange(5, 50) for _ in range(rng.randint(1, 40))]
        s.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True),
                              (2,), 200))
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule(float(steps))
        s.update(out, ex.execute(out), float(steps))
        steps += 1
        if steps % 10 == 0:
            s.check_invariants()
    s.check_invariants()
    assert s.num_preemptions > 0  # the pool was tight: preemption ran beside eviction
    assert s.kv.num_evicted_blocks > 0
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks and not s.kv.req_blocks
    assert s.evictor._state == {}


def test_invariants_catch_a_table_out_of_step_and_a_request_over_budget():
    s = make_evicting("sink", budget=16, block_size=4)
    s.add_request(make_request("a", prompt_len=8, max_tokens=40))
    ex = TableMirror()
    for t in range(20):
        out = s.schedule(float(t))
        s.update(out, ex.execute(out), float(t))
    s.check_invariants()
    r = s.requests["a"]
    r.num_evicted_tokens += 4  # a block counted as evicted that is still in the table
    with pytest.raises(AssertionError, match="blocks for"):
        s.check_invariants()
    r.num_evicted_tokens -= 4
    s.evictor.config = EvictionConfig("sink", 8)  # the same table, judged against a smaller budget
    with pytest.raises(AssertionError, match="budget"):
        s.check_invariants()
