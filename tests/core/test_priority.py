"""Priority scheduling (core/policies/priority.py): queue order, victims under KV pressure, and room made at the next
step for a waiting request that outranks running ones; with every priority equal, the same steps as FCFS."""

from __future__ import annotations

import random

import pytest

from conveyor.core import Request, SchedulerConfig
from conveyor.core.policies import BATCH_PRIORITY
from conveyor.core.policies.priority import PriorityWaitingQueue
from conveyor.core.request import RequestStatus
from tests.helpers.core import FakeExecutor, make_request, make_scheduler, step


def req(rid: str, priority: int = 0, prompt_len: int = 8, max_tokens: int = 20, arrival: float = 0.0,
        first_token: int = 10) -> Request:
    r = make_request(rid, prompt_len, max_tokens, first_token=first_token, priority=priority)
    r.arrival_time = r.times.arrival = arrival
    return r


def test_waiting_queue_orders_by_priority_then_arrival_and_preempted_go_first_among_equals():
    q = PriorityWaitingQueue()
    late_urgent, early_batch, early, later = req("u", -5, arrival=3), req("b", 9, arrival=0), req("e", 0, arrival=1), \
        req("l", 0, arrival=2)
    for r in (early_batch, later, late_urgent, early):
        q.append(r)
    assert [r.request_id for r in q] == ["u", "e", "l", "b"]
    resumed = req("r", 0, arrival=1)
    q.appendleft(resumed)  # preempted: ahead of the requests of its priority and arrival
    assert [r.request_id for r in q] == ["u", "r", "e", "l", "b"]
    q.remove(early)
    assert q.popleft() is late_urgent and q[0] is resumed and len(q) == 3


def test_default_is_priority_for_continuous_batching_and_fcfs_for_the_baselines():
    assert SchedulerConfig().scheduling_policy == "priority"
    assert SchedulerConfig(policy="static").scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="scheduling_policy priority runs with"):
        SchedulerConfig(policy="dynamic", scheduling_policy="priority")
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SchedulerConfig(scheduling_policy="lifo")


def test_kv_pressure_preempts_the_lowest_priority_not_the_newest():
    # 5 blocks of 4 tokens; a (urgent, admitted last) and b (batch) hold 2 blocks each and need a third to decode
    s = make_scheduler(num_blocks=5, block_size=4, enable_prefix_caching=False)
    ex = FakeExecutor()
    b = req("b", BATCH_PRIORITY, first_token=500)
    s.add_request(b)
    step(s, ex)
    a = req("a", 0, arrival=1.0)
    s.add_request(a)
    step(s, ex)
    out, _ = step(s, ex)
    assert out.preempted_req_ids == {"b"} and b.status is RequestStatus.PREEMPTED
    assert a.status is RequestStatus.RUNNING and "a" in out.num_scheduled_tokens
    s.check_invariants()


def test_a_waiting_request_that_outranks_running_ones_takes_a_seat_at_the_next_step():
    s = make_scheduler(max_num_seqs=2)
    ex = FakeExecutor()
    batch = [req(f"b{i}", BATCH_PRIORITY, first_token=100 * i + 10, arrival=i) for i in range(3)]
    for r in batch:
        s.add_request(r)
    step(s, ex)
    assert [r.request_id for r in s.running] == ["b0", "b1"]
    s.add_request(req("u", 0, arrival=5.0, first_token=900))
    out, _ = step(s, ex)
    assert out.preempted_req_ids == {"b1"}, "the newest of the lowest priority gives up its seat"
    assert "u" in out.num_scheduled_tokens and "b0" in out.num_scheduled_tokens
    assert [r.request_id for r in s.waiting] == ["b1", "b2"]
    s.check_invariants()
    # an equal priority never takes a seat this way
    s2 = make_scheduler(max_num_seqs=1)
    s2.add_request(req("x", 3))
    step(s2, ex)
    s2.add_request(req("y", 3, arrival=1.0, first_token=700))
    out, _ = step(s2, ex)
    assert not out.preempted_req_ids and list(out.num_scheduled_tokens) == ["x"]


def test_lower_priority_prompt_chunks_wait_while_a_higher_priority_prompt_takes_the_budget():
    s = make_scheduler(max_num_batched_tokens=16, num_blocks=64)
    ex = FakeExecutor()
    long_batch = req("b", BATCH_PRIORITY, prompt_len=64)
    s.add_request(long_batch)
    out, _ = step(s, ex)
    assert out.num_scheduled_tokens == {"b": 16}
    s.add_request(req("u", 0, prompt_len=12, arrival=1.0, first_token=900))
    out, _ = step(s, ex)
    assert out.num_scheduled_tokens == {"u": 12}, "the batch's chunk is held: the urgent prompt runs whole"
    assert not out.preempted_req_ids and long_batch.status is RequestStatus.RUNNING
    out, _ = step(s, ex)
    assert out.num_scheduled_tokens == {"u": 1, "b": 15}, "nothing outranks it any more: it goes on"
    s.check_invariants()


def test_blocks_are_taken_from_the_lowest_priority_for_a_prompt_that_does_not_fit():
    s = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False, max_num_batched_tokens=64)
    ex = FakeExecutor()
    s.add_request(req("b", BATCH_PRIORITY, prompt_len=20, max_tokens=50))
    step(s, ex)  # 5 of 6 blocks
    s.add_request(req("u", 1, prompt_len=8, arrival=1.0, first_token=900))
    out, _ = step(s, ex)
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens.get("u") == 8
    s.check_invariants()


def _drive(scheduling_policy: str, seed: int) -> list[tuple]:
    """A random trace with every priority 0: every step's schedule, for comparison."""
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
                       scheduling_policy=scheduling_policy)
    ex = FakeExecutor(random.Random(seed))
    schedule, now, arrivals = [], 0.0, []
    for i in range(30):
        arrivals.append(req(f"r{i}", 0, prompt_len=rng.randrange(1, 30), max_tokens=rng.randrange(1, 12),
                            arrival=i * 0.5, first_token=rng.randrange(10, 60)))
    while arrivals or s.has_unfinished_requests():
        while arrivals and arrivals[0].arrival_time <= now:
            s.add_request(arrivals.pop(0))
        out, _ = step(s, ex, now)
        s.check_invariants()
        schedule.append((sorted(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids)))
        now += 0.25
    return schedule


@pytest.mark.parametrize("seed", range(4))
def test_equal_priorities_schedule_exactly_as_fcfs(seed):
    assert _drive("priority", seed) == _drive("fcfs", seed)


def test_a_step_slack_caps_what_lower_priorities_add_to_a_step_of_higher_ones():
    # steps cost 10 ms + 1 ms a token (the scheduler measures them): with a slack of 0.5, two interactive decodes
    # (a 12 ms step) leave 6 ms, six tokens, to the batch
    s = make_scheduler(max_num_batched_tokens=64, num_blocks=256, priority_step_slack=0.5)
    ex = FakeExecutor()
    now = 0.0

    def timed_step():
        nonlocal now
        out = s.schedule(now)
        now += 0.010 + 0.001 * out.total_num_scheduled_tokens
        s.update(out, ex.execute(out), now)
        s.check_invariants()
        return out

    for i in range(2):
        s.add_request(req(f"u{i}", 0, prompt_len=8 + 8 * i, max_tokens=200, arrival=float(i), first_token=900 + 50 * i))
    for _ in range(3):
        timed_step()  # prompts, then decodes: two step sizes measured
    for i in range(3):
        s.add_request(req(f"b{i}", BATCH_PRIORITY, prompt_len=100, max_tokens=50, arrival=10.0 + i,
                          first_token=100 * i + 10))
    batch_tokens = []
    for _ in range(30):
        out = timed_step()
        assert out.num_scheduled_tokens["u0"] == 1 and out.num_scheduled_tokens["u1"] == 1
        batch_tokens.append(sum(n for rid, n in out.num_scheduled_tokens.items() if rid.startswith("b")))
    assert max(batch_tokens) <= 6 and sum(batch_tokens) >= 30 * 5, batch_tokens
    # without the slack the batch takes the whole budget that is left
    s2 = make_scheduler(max_num_batched_tokens=64, num_blocks=256)
    s2.add_request(req("u", 0, max_tokens=200))
    step(s2, ex)
    s2.add_request(req("b", BATCH_PRIORITY, prompt_len=100, arrival=1.0, first_token=700))
    out, _ = step(s2, ex)
    assert out.num_scheduled_tokens == {"u": 1, "b": 63}


def _timed(s, ex, fixed=0.010, per_token=0.001):
    """A step function whose steps cost ``fixed + per_token x tokens`` on the clock the scheduler measures."""
    clock = [0.0]

    def timed_step():
        out = s.schedule(clock[0])
        clock[0] += fixed + per_token * out.total_num_scheduled_tokens
        s.update(out, ex.execute(out), clock[0])
        s.check_invariants()
        return out
    return timed_step


def _batch_tokens(out) -> int:
    return sum(n for rid, n in out.num_scheduled_tokens.items() if rid.startswith("b"))


@pytest.mark.parametrize("fixed,per_token", [(0.010, 0.001), (0.010, 0.0)])
def test_with_no_slack_the_batch_computes_nothing_in_the_step_that_admits_an_interactive_request(fixed, per_token):
    # the batch decodes alone (two step sizes measured: a cost line; with per_token 0 every step took the same
    # time); an interactive request arrives: the step that admits it is an interactive step, so at slack 0 the
    # batch's decodes wait in it as in the interactive decode steps after it, also once the measured window holds
    # only its one-token steps (no line fits them: the last one stands)
    s = make_scheduler(max_num_batched_tokens=64, num_blocks=256, priority_step_slack=0.0)
    timed_step = _timed(s, FakeExecutor(), fixed, per_token)
    for i in range(3):
        s.add_request(req(f"b{i}", BATCH_PRIORITY, prompt_len=10 + 5 * i, max_tokens=100, arrival=float(i),
                          first_token=100 * i + 10))
    for _ in range(4):
        assert _batch_tokens(timed_step()) > 0  # prompts, then decodes: the batch alone takes what it needs
    s.add_request(req("u", 0, prompt_len=12, max_tokens=80, arrival=10.0, first_token=900))
    steps = [timed_step() for _ in range(80)]
    assert [out.num_scheduled_tokens.get("u") for out in steps] == [12] + [1] * 79
    assert [_batch_tokens(out) for out in steps] == [0] * 80
    assert _batch_tokens(timed_step()) == 3  # u finished: the batch decodes again
