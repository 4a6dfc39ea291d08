"""Scenario tests of the baselines: static and dynamic batching, and the slab KV layout (fake executor)."""

import random

import pytest

from conveyor.core import POLICIES, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput
from conveyor.core.kv_manager import KVCacheManager
from conveyor.core.policies import OnFinish, make_policy
from conveyor.core.slab_manager import SlabKVManager
from tests.helpers.core import FakeExecutor, make_request, make_requests, make_scheduler, step


def run_until_idle(s, ex, now=0.0, max_steps=1000):
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return outs
        out, updates = step(s, ex, now)
        s.check_invariants()
        outs.append((out, updates))
    raise AssertionError("did not drain")


def test_static_pads_prefill_and_keeps_finished_slots_until_batch_drains():
    s = make_scheduler(policy="static", max_num_seqs=2)
    s.add_request(make_request("short", prompt_len=4, max_tokens=2))
    s.add_request(make_request("long", prompt_len=10, max_tokens=5, first_token=200))
    s.add_request(make_request("next", prompt_len=4, max_tokens=1, first_token=400))
    ex = FakeExecutor()

    out, updates = step(s, ex)  # one padded prefill of both members; "next" waits for the next batch
    assert out.num_scheduled_tokens == {"short": 4, "long": 10}
    assert out.num_padding_tokens == 6 and out.num_idle_slot_tokens == 0
    assert [r.request_id for r in s.waiting] == ["next"]

    out, updates = step(s, ex)  # both decode; "short" produces its last token and is reported finished
    assert {u.request_id: u.finished for u in updates} == {"short": True, "long": False}
    assert s.requests["short"].is_finished and "short" in {r.request_id for r in s.running}

    idle_tokens = 0
    for _ in range(3):  # "long" needs 3 more tokens; "short" keeps decoding in its slot, output discarded
        out, updates = step(s, ex)
        s.check_invariants()
        assert out.num_scheduled_tokens == {"short": 1, "long": 1} and "next" not in out.num_scheduled_tokens
        assert [u.request_id for u in updates] == ["long"]
        idle_tokens += out.num_idle_slot_tokens
    assert idle_tokens == 3 and updates[0].finished

    out, _ = step(s, ex)  # the batch drained: both slots are released and the next batch forms
    assert out.finished_req_ids >= {"short", "long"}
    assert out.num_scheduled_tokens == {"next": 4} and out.num_padding_tokens == 0
    assert s.kv.block_ids("short") == [] and s.kv.block_ids("long") == []


def test_a_parked_victim_is_released_not_preempted():
    # 3 blocks of 4 tokens: after both prefills one block is free; "b" (admitted first) takes it for its next
    # token, so the parked "a" must give way. Releasing it loses nothing: it is not a preemption.
    s = make_scheduler(policy="static", max_num_seqs=2, num_blocks=3, block_size=4, enable_prefix_caching=False)
    b, a = make_request("b", prompt_len=4, max_tokens=6, first_token=300), make_request("a", prompt_len=4, max_tokens=1)
    s.add_request(b)
    s.add_request(a)
    ex = FakeExecutor()
    step(s, ex)
    assert a.status is RequestStatus.PARKED
    out, _ = step(s, ex)
    assert out.num_scheduled_tokens == {"b": 1} and not out.preempted_req_ids
    assert a.status is RequestStatus.FINISHED_LENGTH and a not in s.running and a not in s.waiting
    assert s.num_preemptions == 0 and a.num_preemptions == 0
    assert "a" in s.schedule(1.0).finished_req_ids  # the executor is told to forget it, as for any retirement
    s.check_invariants()


def test_policies_are_registered_once_by_name_and_return_decisions():
    assert list(POLICIES) == ["static", "dynamic", "continuous", "chunked"]
    with pytest.raises(ValueError, match="policy must be one of static, dynamic, continuous, chunked"):
        make_policy(SchedulerConfig(policy="fifo"))
    r = make_request("r")
    assert make_policy(SchedulerConfig(policy="chunked")).on_finished(r) is OnFinish.RETIRE
    assert make_policy(SchedulerConfig(policy="dynamic")).on_finished(r) is OnFinish.PARK


def test_static_begin_step_hands_back_a_drained_batch_without_touching_the_queues():
    policy = make_policy(SchedulerConfig(policy="static", max_num_seqs=2, max_model_len=64))
    x, y = make_request("x"), make_request("y", first_token=300)
    running, waiting = [x, y], []
    policy.begin_step([], [x, y], 0.0)  # a batch forms from whoever waits
    assert policy.admits(x) and policy.admits(y)
    policy.end_step(SchedulerOutput(), running)
    assert policy.begin_step(running, waiting, 1.0) == [] and not policy.admits(make_request("z"))
    x.status = y.status = RequestStatus.PARKED
    assert policy.begin_step(running, waiting, 2.0) == [x, y] and running == [x, y]  # the scheduler retires them


def test_static_user_visible_finish_is_own_completion_not_batch_drain():
    s = make_scheduler(policy="static", max_num_seqs=4)
    a, b = make_request("a", max_tokens=1), make_request("b", max_tokens=4, first_token=300)
    s.add_request(a)
    s.add_request(b)
    ex = FakeExecutor()
    _, updates = step(s, ex, now=0.0)
    assert [(u.request_id, u.finished, u.finish_reason) for u in updates] == [("a", True, "length"), ("b", False, None)]
    assert a.status is RequestStatus.PARKED and a.is_finished and a in s.running  # its slot is held
    for t in range(1, 6):
        step(s, ex, now=float(t))
    assert a.times.finished == 0.0  # its only token came in the first step
    assert b.times.finished == 3.0
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH and not s.running and not s.requests
    assert len(a.output_token_ids) >= 1


def test_static_forms_batch_of_all_waiting_and_late_arrivals_wait_for_drain():
    s = make_scheduler(policy="static", max_num_seqs=8)
    for r in make_requests(3, max_tokens=3):
        s.add_request(r)
    ex = FakeExecutor()
    out, _ = step(s, ex)
    assert len(out.num_scheduled_tokens) == 3
    s.add_request(make_request("late", first_token=900))
    for _ in range(2):  # tokens 2 and 3 of the batch; "late" must wait for the drain
        out, _ = step(s, ex)
        assert "late" not in out.num_scheduled_tokens
    out, _ = step(s, ex)
    assert list(out.num_scheduled_tokens) == ["late"]


def test_dynamic_starts_at_max_wait_and_admits_arrivals_while_forming():
    s = make_scheduler(policy="dynamic", max_num_seqs=4, max_wait_ms=100)
    ex = FakeExecutor()
    first = make_request("first")
    first.arrival_time = 0.0
    s.add_request(first)
    out, _ = step(s, ex, now=0.05)
    assert out.is_empty  # 50 ms < max_wait_ms, and the batch is not full
    late = make_request("late", first_token=500)
    late.arrival_time = 0.08
    s.add_request(late)
    out, _ = step(s, ex, now=0.09)
    assert out.is_empty
    out, _ = step(s, ex, now=0.10)  # the oldest has waited 100 ms: the batch starts with both
    assert set(out.num_scheduled_tokens) == {"first", "late"}


def test_dynamic_starts_when_max_num_seqs_wait():
    s = make_scheduler(policy="dynamic", max_num_seqs=3, max_wait_ms=10_000)
    ex = FakeExecutor()
    for r in make_requests(2):
        s.add_request(r)
    assert step(s, ex, now=0.001)[0].is_empty
    s.add_request(make_request("third", first_token=900))
    out, _ = step(s, ex, now=0.002)
    assert len(out.num_scheduled_tokens) == 3


def make_slab_scheduler(num_blocks, block_size=4, max_model_len=32, **overrides):
    config = SchedulerConfig(**{"max_model_len": max_model_len, "max_num_batched_tokens": 64, **overrides})
    return Scheduler(config, SlabKVManager(num_blocks, block_size, max_model_len))


def test_slab_admits_no_more_than_memory_over_max_model_len():
    s = make_slab_scheduler(num_blocks=30, block_size=4, max_model_len=32)  # 8 blocks a slab: 3 slabs
    for r in make_requests(5, prompt_len=4, max_tokens=2):
        s.add_request(r)
    out, _ = step(s, FakeExecutor())
    assert len(out.num_scheduled_tokens) == 3 and s.num_waiting == 2
    assert s.kv.usage() == pytest.approx(24 / 30)
    assert s.kv.num_reserved_slots() == 3 * 32
    new = out.scheduled_new_reqs[0]
    assert new.block_ids == list(range(8))  # the whole contiguous slab, handed over at admission
    s.check_invariants()


def test_slab_reserves_whole_slabs_while_paged_reserves_what_is_used():
    for kv, expected in ((SlabKVManager(64, 4, 32), 32), (KVCacheManager(64, 4), 8)):
        s = Scheduler(SchedulerConfig(max_model_len=32), kv)
        s.add_request(make_request("a", prompt_len=6, max_tokens=4))
        step(s, FakeExecutor())
        assert kv.num_reserved_slots() == expected


@pytest.mark.parametrize("policy", ["static", "dynamic", "continuous", "chunked"])
@pytest.mark.parametrize("layout", ["paged", "slab"])
@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_drives_to_completion_with_invariants(policy, layout, seed):
    rng = random.Random(seed)
    max_model_len = 64
    kw = dict(policy=policy, max_num_seqs=rng.choice([1, 3, 8]), max_num_batched_tokens=rng.choice([8, 32, 64]),
              max_wait_ms=rng.choice([0, 20]))
    block_size = rng.choice([1, 4, 8])
    num_blocks = rng.randint(max_model_len // block_size, 3 * max_model_len // block_size)
    if layout == "slab":
        s = make_slab_scheduler(num_blocks, block_size, max_model_len, **kw)
    else:
        s = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len, **kw)
    ex = FakeExecutor(rng)
    pending = [make_request(f"r{i}", prompt_len=rng.randint(1, 40), max_tokens=rng.randint(1, 20),
                            first_token=rng.randint(5, 1000)) for i in range(20)]
    for r in pending:
        r.max_model_len = max_model_len
    finished = {}
    now = 0.0
    for _ in range(5000):
        while pending and rng.random() < 0.3:
            r = pending.pop(0)
            r.arrival_time = now
            s.add_request(r)
        if not pending and not s.has_unfinished_requests():
            break
        out, updates = step(s, ex, now)
        s.check_invariants()
        assert out.num_idle_slot_tokens <= out.total_num_scheduled_tokens
        if policy in ("continuous", "chunked"):
            assert out.num_padding_tokens == 0 and out.num_idle_slot_tokens == 0
        for u in updates:
            if u.finished:
                assert u.request_id not in finished
                finished[u.request_id] = u
        now += 0.01
    assert len(finished) == 20 and not s.running and not s.waiting
    assert s.kv.usage() == 0 or layout == "paged"  # paged keeps cached blocks around; slab frees everything
