"""The discrete-event loop: the real ``core.Scheduler`` stepped on a virtual clock. PURE PYTHON.

It is the benchmark's replay driver (``bench/online.py``) with the clock replaced: add every request whose
arrival time has passed, schedule, execute (the step takes the cost model's seconds), update, repeat; when
nothing waits, jump to the next arrival. A request arriving during a step waits for the step to end, and its
TTFT counts from its arrival. When work exists but nothing is scheduled (a dynamic batch still forming) the
clock advances by ``idle_poll_s``, as the real driver sleeps.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from conveyor.core.config import IDLE_POLL_S
from conveyor.core.outputs import SchedulerOutput
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler
from conveyor.sim.cost_model import StepCost
from conveyor.sim.executor import SimExecutor

MAX_IDLE_POLLS = 1_000_000  # empty schedules in a row, with nothing left to arrive, before calling it a livelock


class StepObserver(Protocol):
    """Sees every step, like the engine's step listeners: before it executes, and after the scheduler's update."""

    def before_step(self, start: float, so: SchedulerOutput, scheduler: Scheduler) -> None: ...

    def after_step(self, end: float, scheduler: Scheduler, cost: StepCost) -> None: ...


@dataclass
class SimulatedRequest:
    """A finished request: the scheduler's ``Request`` (times, preemptions) and when each output token came."""

    request: Request
    token_times: list[float] = field(default_factory=list)


# Whether an arriving request is admitted (SLO-aware admission), from the scheduler's state at its arrival
Admit = Callable[[Request, Scheduler, float], bool]
# Requests a finished one brings (a closed-loop client sends its next request when its last one ends)
Follow = Callable[[Request, float], list[Request]]


@dataclass
class SimResult:
    requests: list[SimulatedRequest]  # in the order they finished
    duration_s: float  # virtual seconds from 0 to the end of the last step
    num_steps: int
    busy_s: float  # virtual seconds spent inside steps
    refused: list[Request] = field(default_factory=list)  # turned away at arrival by ``admit``


def simulate(scheduler: Scheduler, executor: SimExecutor, requests: list[Request],
             observer: StepObserver | None = None, idle_poll_s: float = IDLE_POLL_S,
             max_idle_polls: int = MAX_IDLE_POLLS, admit: Admit | None = None,
             follow: Follow | None = None) -> SimResult:
    """Run ``requests`` (their ``arrival_time`` in seconds from 0) through ``scheduler`` until every one ends.
    ``admit`` may turn an arriving request away; ``follow`` adds the requests a finished one brings."""
    pending = sorted(requests, key=lambda r: r.arrival_time)
    by_id = {r.request_id: r for r in pending}
    token_times: dict[str, list[float]] = {}
    done: list[SimulatedRequest] = []
    refused: list[Request] = []
    clock = busy = 0.0
    num_steps = i = idle_polls = 0
    while i < len(pending) or scheduler.has_unfinished_requests():
        while i < len(pending) and pending[i].arrival_time <= clock:
            if admit is None or admit(pending[i], scheduler, clock):
                scheduler.add_request(pending[i])
                token_times[pending[i].request_id] = []
            else:
                refused.append(pending[i])
            i += 1
        if not scheduler.has_unfinished_requests():
            if i < len(pending):
                clock = pending[i].arrival_time
            continue
        so = scheduler.schedule(clock)
        if so.is_empty:
            idle_polls = idle_polls + 1 if i == len(pending) else 0
            if idle_polls > max_idle_polls:
                raise RuntimeError(f"the scheduler schedules nothing while {scheduler.num_waiting} requests wait and "
                                   f"{scheduler.num_running} hold slots, and nothing else will arrive: a livelock")
            clock += idle_poll_s
            continue
        idle_polls = 0
        if observer is not None:
            observer.before_step(clock, so, scheduler)
        model_out, cost = executor.step(so)
        end = clock + cost.seconds
        for update in scheduler.update(so, model_out, end):
            times = token_times[update.request_id]
            times.append(end)
            if update.finished:
                done.append(SimulatedRequest(by_id[update.request_id], times))
                for new in follow(by_id[update.request_id], end) if follow is not None else ():
                    by_id[new.request_id] = new
                    pending.insert(bisect.bisect(pending, new.arrival_time, lo=i, key=lambda r: r.arrival_time), new)
        if observer is not None:
            observer.after_step(end, scheduler, cost)
        busy += cost.seconds
        num_steps += 1
        clock = end
    return SimResult(done, clock, num_steps, busy, refused)

