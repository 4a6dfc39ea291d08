"""The simulator runs the real scheduler: on the same trace it schedules exactly what the real engine schedules.

The real side is ``LLMEngine`` with its torch ``ModelRunner`` on a tiny random checkpoint, replayed by the
benchmark's driver; the simulated side is the same workload through ``bench.simulate`` with a constant-cost model.
Every request arrives at t=0, so the schedule cannot depend on how long the real steps took.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from conveyor.bench.online import replay
from conveyor.bench.simulate import StepRecorder, build_scheduler, sim_requests
from conveyor.bench.workload import Workload, WorkloadRequest
from conveyor.engine.args import EngineArgs
from conveyor.sim import ConstantCostModel, SimExecutor, simulate

MAX_MODEL_LEN = 512


def tiny_longtail(n: int, seed: int, shared_prefix: int = 0) -> Workload:
    """Short chat-like and long RAG-like requests over the tiny vocabulary, all at t=0."""
    rng = random.Random(seed)
    prefix = [rng.randrange(4, 384) for _ in range(shared_prefix)]
    reqs = []
    for i in range(n):
        long = rng.random() < 0.25
        prompt_len = rng.randint(120, 300) if long else rng.randint(3, 40)
        prompt = prefix + [rng.randrange(4, 384) for _ in range(prompt_len)]
        reqs.append(WorkloadRequest(i, 0.0, prompt, None, rng.randint(1, 30 if long else 12), "",
                                    {"temperature": 0.0, "ignore_eos": True}))
    return Workload("tiny", reqs)


def real_schedule(args: EngineArgs, workload: Workload) -> tuple[list[dict[str, int]], int]:
    """Scheduled tokens per request per step of a real run, and how many preemptions it made."""
    from conveyor.engine.llm_engine import LLMEngine

    result = replay(LLMEngine(args), workload)
    assert len(result.timings) == len(workload.requests)
    return [dict(s.num_scheduled_tokens) for s in result.steps], result.num_preemptions


def simulated_schedule(args: EngineArgs, workload: Workload) -> list[dict[str, int]]:
    recorder = StepRecorder()
    scheduler = build_scheduler(args, args.num_kv_blocks, MAX_MODEL_LEN)
    result = simulate(scheduler, SimExecutor(ConstantCostModel(0.01)), sim_requests(workload, 1.0, MAX_MODEL_LEN),
                      recorder)
    assert len(result.requests) == len(workload.requests)
    return [dict(s.num_scheduled_tokens) for s in recorder.steps]


CASES = {  # name -> (knobs, whether its small KV cache forces recompute preemptions on its trace)
    "static": (dict(policy="static", max_num_seqs=6, num_kv_blocks=48), False),
    "dynamic": (dict(policy="dynamic", max_num_seqs=8, num_kv_blocks=33), True),
    "continuous": (dict(policy="continuous", max_num_seqs=16, num_kv_blocks=48), True),
    "chunked": (dict(policy="chunked", max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=36), True),
    "chunked-threshold": (dict(policy="chunked", max_num_seqs=16, long_prefill_token_threshold=24,
                               num_kv_blocks=40), True),
    "continuous-slab": (dict(policy="continuous", max_num_seqs=16, kv_layout="slab", num_kv_blocks=128), False),
    "static-slab": (dict(policy="static", max_num_seqs=6, kv_layout="slab", num_kv_blocks=128), False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_constant_cost_simulation_reproduces_the_real_schedule(tiny_llama_dir, case):
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", block_size=16, max_model_len=MAX_MODEL_LEN,
                      detokenize=False, debug_invariants=True, **CASES[case][0])
    workload = tiny_longtail(16, seed=len(case))
    real, preemptions = real_schedule(args, workload)
    sim = simulated_schedule(args, workload)
    assert len(real) > len(workload.requests)  # many steps, not one batch
    assert (preemptions > 0) == CASES[case][1]
    assert sim == real


def test_prefix_cache_hits_are_reproduced(tiny_llama_dir):
    """Shared prompt prefixes: the simulated KV manager finds the same cached blocks, so it schedules the same
    (shorter) prefills; and the case would fail without prefix caching in one of the two worlds."""
    base = EngineArgs(model=str(tiny_llama_dir), dtype="float32", block_size=16, max_model_len=MAX_MODEL_LEN,
                      detokenize=False, policy="chunked", max_num_seqs=8, max_num_batched_tokens=128,
                      num_kv_blocks=64)
    workload = tiny_longtail(12, seed=5, shared_prefix=64)
    real, _ = real_schedule(base, workload)
    assert simulated_schedule(base, workload) == real
    assert simulated_schedule(replace(base, enable_prefix_caching=False), workload) != real


@pytest.mark.parametrize("eviction", ["lru", "cost"])
def test_prefix_cache_eviction_under_pressure_is_reproduced(tiny_llama_dir, eviction):
    """A KV cache small enough that cached prefixes are evicted: the simulator, driving the same KV manager with
    the same eviction policy, schedules what the real engine schedules, hits and all."""
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", block_size=16, max_model_len=MAX_MODEL_LEN,
                      detokenize=False, policy="chunked", max_num_seqs=8, max_num_batched_tokens=128,
                      num_kv_blocks=40, prefix_cache_eviction=eviction)
    workload = tiny_longtail(16, seed=7, shared_prefix=48)
    from conveyor.engine.llm_engine import LLMEngine

    engine = LLMEngine(args)
    result = replay(engine, workload)
    assert engine.kv_manager.pool.num_evictions > 0  # the pressure is real
    real_hits = [dict(s.num_cached_tokens) for s in result.steps]
    recorder = StepRecorder()
    scheduler = build_scheduler(args, args.num_kv_blocks, MAX_MODEL_LEN)
    simulate(scheduler, SimExecutor(ConstantCostModel(0.01)), sim_requests(workload, 1.0, MAX_MODEL_LEN), recorder)
    assert [dict(s.num_scheduled_tokens) for s in recorder.steps] == [dict(s.num_scheduled_tokens)
                                                                       for s in result.steps]
    assert [dict(s.num_cached_tokens) for s in recorder.steps] == real_hits
    assert sum(sum(h.values()) for h in real_hits) == engine.kv_manager.prefix_saved_tokens > 0


@pytest.mark.parametrize("policy", ["sink", "h2o"])
def test_kv_eviction_is_reproduced_and_priced_by_the_keys_kept(tiny_llama_dir, policy):
    """Under KV eviction the simulator schedules what the real engine schedules (chunk caps, blocks given back,
    more requests admitted), and its cost model sees each request's kept keys, not its positions: the cost model
    learns the budget. The simulator returns no attention scores, so h2o there drops the oldest unprotected
    blocks; which blocks go changes no step's token counts."""
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", block_size=16, max_model_len=MAX_MODEL_LEN,
                      detokenize=False, debug_invariants=True, policy="chunked", max_num_seqs=16,
                      max_num_batched_tokens=128, num_kv_blocks=40, kv_eviction=policy, kv_budget_tokens=64)
    workload = tiny_longtail(16, seed=3)
    real, _ = real_schedule(args, workload)
    shapes = []

    class Recording(ConstantCostModel):
        def step_cost(self, shape):
            shapes.append(shape)
            return super().step_cost(shape)

    recorder = StepRecorder()
    scheduler = build_scheduler(args, args.num_kv_blocks, MAX_MODEL_LEN)
    simulate(scheduler, SimExecutor(Recording(0.01)), sim_requests(workload, 1.0, MAX_MODEL_LEN), recorder)
    assert [dict(s.num_scheduled_tokens) for s in recorder.steps] == real
    assert scheduler.kv.num_evicted_blocks > 0
    budget_blocks = 64 // 16
    # keys before a row's queries: at most the budget + 1 blocks less the room for the step's own tokens
    assert max(computed + q for shape in shapes for q, computed in shape.rows) <= (budget_blocks + 1) * 16
    assert max(len(w.prompt_token_ids) + w.max_tokens for w in workload.requests) > 5 * 16  # budgets bind


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_a_preempted_batch_member_gets_the_blocks_of_parked_slots(policy):
    """On this trace a batch member is preempted while another member, parked at max_model_len, holds 32 of the
    33 blocks: the parked slot must be released for the member to resume (it once waited forever)."""
    args = EngineArgs(model="unused", block_size=16, max_model_len=MAX_MODEL_LEN, policy=policy, max_num_seqs=16,
                      num_kv_blocks=33)
    scheduler = build_scheduler(args, args.num_kv_blocks, MAX_MODEL_LEN)
    workload = tiny_longtail(16, seed=7)
    result = simulate(scheduler, SimExecutor(ConstantCostModel(0.01)), sim_requests(workload, 1.0, MAX_MODEL_LEN),
                      max_idle_polls=1000)
    assert scheduler.num_preemptions >= 1
    assert sorted(int(r.request.request_id) for r in result.requests) == list(range(16))
    assert all(len(r.token_times) == r.request.sampling_params.max_tokens for r in result.requests)


def test_a_traces_per_request_kv_budget_reaches_the_simulated_scheduler():
    workload = Workload("w", [WorkloadRequest(0, 0.0, [5] * 40, None, 8, "", {"kv_budget_tokens": 24,
                                                                              "temperature": 0.7}),
                              WorkloadRequest(1, 0.0, [5] * 40, None, 8, "", {})])
    budgets = [r.sampling_params.kv_budget_tokens for r in sim_requests(workload, 1.0, MAX_MODEL_LEN)]
    assert budgets == [24, None]


def test_sliding_window_freeing_is_reproduced(tmp_path):
    """A windowed model (tiny Mistral, window 8): the simulated KV manager gives back the blocks outside the
    window as the real one does (the same schedule, step for step), which runs more requests at once than holding
    every block would in the same memory."""
    from conveyor.engine.llm_engine import LLMEngine
    from tests.helpers.families import VOCAB, save_tiny

    save_tiny(tmp_path, "mistral")
    rng = random.Random(3)
    workload = Workload("windowed", [WorkloadRequest(i, 0.0, [rng.randrange(4, VOCAB) for _ in range(rng.randint(30, 90))],
                                                     None, rng.randint(4, 20), "", {"temperature": 0.0,
                                                                                    "ignore_eos": True})
                                     for i in range(10)])
    args = EngineArgs(model=str(tmp_path), dtype="float32", block_size=4, max_model_len=128, detokenize=False,
                      policy="chunked", max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=40,
                      debug_invariants=True)
    engine = LLMEngine(args)
    result = replay(engine, workload)
    windows = engine.model_info.spec.layer_windows
    assert windows == (8, 8)
    schedules = {}
    for free in (True, False):
        recorder = StepRecorder()
        scheduler = build_scheduler(replace(args, free_outside_window=free), 40, 128, windows)
        simulate(scheduler, SimExecutor(ConstantCostModel(0.01)), sim_requests(workload, 1.0, 128), recorder)
        schedules[free] = [dict(s.num_scheduled_tokens) for s in recorder.steps]
        if free:
            peak_freed = max(s.num_running for s in recorder.steps)
        else:
            peak_held = max(s.num_running for s in recorder.steps)
    assert schedules[True] == [dict(s.num_scheduled_tokens) for s in result.steps]
    assert peak_freed > peak_held
