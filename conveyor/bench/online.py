"""In-process replay: feed a workload into an ``LLMEngine`` at its arrival times and record what happened.

The loop is the simplest honest server: add every request whose arrival time has passed, run one step, repeat;
when there is nothing to do, sleep until the next arrival. A request that arrives while a step runs waits for
that step to end, as it would in a real server, and that wait is part of its TTFT: its arrival is the time it
was due, not the time the loop noticed it. Offline (all at once) is the same driver with every arrival at 0.

It depends only on ``LLMEngine`` (not on the async engine or the HTTP server), so it measures the engine and
scheduler alone. All recorded times are seconds since the start of the run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from conveyor.bench.metrics import RequestTiming
from conveyor.bench.workload import Workload
from conveyor.core.config import IDLE_POLL_S
from conveyor.engine.step_record import StepRecord



@dataclass
class RunResult:
    """One replay: per-request timings and token ids, per-step records, all times relative to the start."""

    timings: list[RequestTiming]
    steps: list[StepRecord]
    duration_s: float
    output_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_preemptions: int = 0


def _relative(record: StepRecord, t0: float) -> StepRecord:
    record.start -= t0
    record.end -= t0
    return record


def _timing(out, t0: float) -> RequestTiming:
    m, comp = out.metrics, out.outputs[0]

    def rel(t: float | None) -> float | None:
        return None if t is None else t - t0

    return RequestTiming(
        request_id=out.request_id, prompt_tokens=len(out.prompt_token_ids), output_tokens=len(comp.token_ids),
        arrival=m.arrival_time - t0, first_token=rel(m.first_token_time), token_times=[t - t0 for t in comp.token_times],
        finished=rel(m.finished_time), first_scheduled=rel(m.first_scheduled_time),
        error=None if comp.finish_reason in ("stop", "length") else f"finish_reason={comp.finish_reason}",
    )


def replay(engine, workload: Workload, time_scale: float = 1.0, progress=None) -> RunResult:
    """Replay ``workload`` into ``engine`` (arrival times multiplied by ``time_scale``) until every request ends.

    ``progress`` is an optional callable invoked with 1 for each finished request (e.g. ``tqdm.update``).
    Requests must use ``n == 1``; their ids are the workload's ids as strings.
    """
    pending = sorted(workload.requests, key=lambda r: r.arrival_s)
    steps: list[StepRecord] = []
    engine.step_listeners.append(steps.append)
    preemptions0 = engine.scheduler.num_preemptions
    timings: list[RequestTiming] = []
    tokens: dict[str, list[int]] = {}
    t0 = time.monotonic()
    i = 0
    try:
        while i < len(pending) or engine.has_unfinished_requests():
            now = time.monotonic()
            while i < len(pending) and t0 + pending[i].arrival_s * time_scale <= now:
                req = pending[i]
                engine.add_request(str(req.id), req.engine_prompt(), req.sampling_params(),
                                   arrival_time=t0 + req.arrival_s * time_scale)
                i += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, t0 + pending[i].arrival_s * time_scale - time.monotonic()))
                continue
            num_steps = len(steps)
            for out in engine.step():
                if out.finished:
                    timings.append(_timing(out, t0))
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
                    if progress is not None:
                        progress(1)
            if len(steps) == num_steps:  # nothing was scheduled (a dynamic batch is still forming)
                time.sleep(IDLE_POLL_S)
    finally:
        engine.step_listeners.remove(steps.append)
    duration = time.monotonic() - t0
    return RunResult(timings, [_relative(s, t0) for s in steps], duration, tokens,
                     engine.scheduler.num_preemptions - preemptions0)
