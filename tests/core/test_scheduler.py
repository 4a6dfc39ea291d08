"""Scenario tests of the scheduler (vLLM style): schedule, feed a fake model output, update, assert."""

import random

import pytest

from conveyor.core import RequestStatus, SamplingParams
from conveyor.core.sliding_window import SlidingWindow
from tests.helpers.core import FakeExecutor, TableMirror, make_request, make_requests, make_scheduler, step


def test_chunked_prefill_splits_prompt_under_budget():
    s = make_scheduler(max_num_batched_tokens=16)
    s.add_request(make_request("a", prompt_len=40, max_tokens=2))
    ex = FakeExecutor()
    chunks, sampled = [], []
    for _ in range(3):
        out, updates = step(s, ex)
        chunks.append(out.num_scheduled_tokens["a"])
        sampled.append(len(updates))
    assert chunks == [16, 16, 8]
    assert sampled == [0, 0, 1]  # only the chunk that completes the prompt produces a token
    out, updates = step(s, ex)
    assert out.num_scheduled_tokens == {"a": 1} and updates[0].finished


def test_decodes_go_first_then_prompt_chunks_fill_budget():
    s = make_scheduler(max_num_batched_tokens=10)
    ex = FakeExecutor()
    s.add_request(make_request("old", prompt_len=4, max_tokens=10))
    step(s, ex)  # old prefilled, now decoding
    s.add_request(make_request("long", prompt_len=30, max_tokens=2))
    out, _ = step(s, ex)
    assert out.num_scheduled_tokens == {"old": 1, "long": 9}
    out, _ = step(s, ex)
    assert out.num_scheduled_tokens == {"old": 1, "long": 9}


def test_continuous_computes_whole_prompt_in_one_step():
    s = make_scheduler(policy="continuous", max_num_batched_tokens=16)
    s.add_request(make_request("a", prompt_len=40, max_tokens=2))
    out, updates = step(s, FakeExecutor())
    assert out.num_scheduled_tokens == {"a": 40} and len(updates) == 1


def test_continuous_waits_when_prompt_does_not_fit_budget():
    s = make_scheduler(policy="continuous", max_num_batched_tokens=50, max_model_len=50)
    s.add_request(make_request("a", prompt_len=40, max_tokens=5))
    s.add_request(make_request("b", prompt_len=40, max_tokens=5, first_token=500))
    out, _ = step(s, FakeExecutor())
    assert list(out.num_scheduled_tokens) == ["a"]


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_num_seqs=2)
    for r in make_requests(4):
        s.add_request(r)
    out, _ = step(s, FakeExecutor())
    assert len(out.num_scheduled_tokens) == 2 and s.num_waiting == 2


def test_preemption_picks_newest_and_skips_admission():
    # 5 blocks of 4 tokens; two requests of 8-token prompts hold 2 blocks each, growing.
    s = make_scheduler(num_blocks=5, block_size=4, enable_prefix_caching=False)
    ex = FakeExecutor()
    a, b = make_request("a", 8, max_tokens=20), make_request("b", 8, max_tokens=20, first_token=500)
    s.add_request(a)
    s.add_request(b)
    step(s, ex)
    s.add_request(make_request("c", 4, max_tokens=2, first_token=900))
    # a and b each need a 3rd block at their first decode: 2+2 held, 1 free -> b (newest) is preempted.
    out, _ = step(s, ex)
    assert out.preempted_req_ids == {"b"}
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert "c" not in out.num_scheduled_tokens, "no admission in a step that preempted"
    assert list(s.waiting)[0] is b
    s.check_invariants()


def test_resumed_request_continues_its_output():
    s = make_scheduler(num_blocks=5, block_size=4, enable_prefix_caching=False)
    ex = FakeExecutor(random.Random(0))
    reqs = [make_request("a", 8, max_tokens=12), make_request("b", 8, max_tokens=12, first_token=500)]
    for r in reqs:
        s.add_request(r)
    outputs = {r.request_id: [] for r in reqs}
    while s.has_unfinished_requests():
        out, updates = step(s, ex)
        for u in updates:
            outputs[u.request_id].append(u.new_token_id)
        s.check_invariants()
    assert s.num_preemptions > 0
    for r in reqs:
        assert outputs[r.request_id] == r.output_token_ids and len(r.output_token_ids) == 12


def test_prefix_cache_hit_skips_computed_blocks():
    s = make_scheduler(block_size=4)
    ex = FakeExecutor()
    s.add_request(make_request("a", prompt_len=10, max_tokens=1))
    step(s, ex)
    s.add_request(make_request("b", prompt_len=10, max_tokens=1))  # same prompt (same first_token)
    out, _ = step(s, ex)
    assert out.num_scheduled_tokens == {"b": 2}  # 8 tokens = 2 full blocks served from the cache
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert s.kv.prefix_hits == 8


def test_full_prompt_hit_still_computes_last_token():
    s = make_scheduler(block_size=4)
    ex = FakeExecutor()
    s.add_request(make_request("a", prompt_len=8, max_tokens=1))
    step(s, ex)
    s.add_request(make_request("b", prompt_len=8, max_tokens=1))
    out, _ = step(s, ex)
    assert out.num_scheduled_tokens == {"b": 4}  # only the first block: the last token must be computed


def test_abort_frees_blocks_and_tells_executor():
    s = make_scheduler()
    ex = FakeExecutor()
    s.add_request(make_request("a", max_tokens=50))
    step(s, ex)
    assert s.kv.usage() > 0
    s.finish_request("a", RequestStatus.FINISHED_ABORTED, 1.0)
    assert s.kv.usage() == 0
    out, _ = step(s, ex)
    assert out.finished_req_ids == {"a"} and not s.has_unfinished_requests()
    s.check_invariants()


def test_stop_on_eos_unless_ignored_and_min_tokens():
    s = make_scheduler()
    r = make_request("a", max_tokens=10, ignore_eos=False, min_tokens=2)
    s.add_request(r)

    class EosExecutor(FakeExecutor):
        def execute(self, out):
            mo = super().execute(out)
            mo.sampled_token_ids = {k: 2 for k in mo.sampled_token_ids}
            return mo

    ex = EosExecutor()
    _, u = step(s, ex)
    assert not u[0].finished  # min_tokens=2 holds EOS back
    _, u = step(s, ex)
    assert u[0].finished and u[0].finish_reason == "stop"


@pytest.mark.parametrize("policy", ["continuous", "chunked"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("windowed", [False, True])
def test_random_drive_to_completion(policy, seed, windowed):
    """Preemption, prefix caching, aborts; with a sliding window, blocks given back as requests advance (a request
    the step schedules holds none before its window) and the executor's tables told so."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    window = SlidingWindow(random.Random(seed).choice([1, 3, 8, 20]), block_size) if windowed else None
    s = make_scheduler(
        num_blocks=rng.randint(40, 120) // block_size * 4 + 8,
        block_size=block_size,
        policy=policy,
        max_num_seqs=rng.randint(1, 12),
        max_num_batched_tokens=rng.choice([8, 32, 128]),
        max_model_len=200,
        enable_prefix_caching=rng.random() < 0.5,
        sliding_window=window.window if window else 0,
    )
    ex = TableMirror(rng, s.kv.null_block_id)
    shared = [rng.randrange(5, 50) for _ in range(24)]
    reqs = []
    for i in range(rng.randint(5, 25)):
        prompt = (shared[: rng.randint(0, 24)] if rng.random() < 0.5 else []) + [
            rng.randrange(5, 50) for _ in range(rng.randint(1, 40))
        ]
        from conveyor.core import Request

        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True), (2,), 200)
        reqs.append(r)
    pending = list(reqs)
    for t in range(5000):
        if pending and rng.random() < 0.3:
            s.add_request(pending.pop(0))
        if rng.random() < 0.02 and s.running:
            s.finish_request(rng.choice(s.running).request_id, RequestStatus.FINISHED_ABORTED, t)
        out = s.schedule(float(t))
        for rid in out.num_scheduled_tokens if window else ():
            table, skipped = s.kv.block_ids(rid), window.num_skipped_blocks(s.requests[rid].num_computed_tokens)
            assert table[:skipped] == [s.kv.null_block_id] * skipped and s.kv.null_block_id not in table[skipped:]
        s.update(out, ex.execute(out), float(t))
        s.check_invariants()
        for rid in s.kv.req_blocks:
            assert ex.tables[rid] == s.kv.block_ids(rid), f"{rid}: the executor's table drifted"
        if not pending and not s.has_unfinished_requests():
            break
    assert not pending and not s.has_unfinished_requests()
    assert all(r.is_finished for r in reqs)
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks and not s.kv.num_skipped
    for r in reqs:
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.sampling_params.max_tokens


def test_partly_computed_block_never_becomes_findable():
    # Regression: the admission lookup hashes the whole prompt; a chunk that ends mid-block must not publish
    # the hash of that half-computed block (a later request would read KV that was never written).
    s = make_scheduler(block_size=4, max_num_batched_tokens=6)
    s.add_request(make_request("a", prompt_len=20, max_tokens=2))
    out, _ = step(s, FakeExecutor())
    assert out.num_scheduled_tokens == {"a": 6}
    blocks = s.kv.req_blocks["a"]
    assert blocks[0].block_hash is not None and blocks[1].block_hash is None
    s.add_request(make_request("b", prompt_len=20, max_tokens=2))
    hits, n = s.kv.get_computed_blocks(s.requests["b"])
    assert n == 4
