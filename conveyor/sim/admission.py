"""SLO-aware admission on the simulator: the server's prediction (``core.admission``) with the step times of the
simulator's cost model, and the load read from the real scheduler's queues. PURE PYTHON."""

from __future__ import annotations

from conveyor.core.admission import EngineShape, InFlight, Prediction, ServiceClass, predict
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler
from conveyor.sim.cost_model import CostModel, StepShape


class CostModelStepTime:
    """``core.admission.StepTime`` priced by a simulator cost model: a step of ``num_reqs`` rows, the decodes at a
    typical context of ``context_tokens`` and, with ``has_chunk``, one prompt chunk holding the rest."""

    def __init__(self, cost_model: CostModel, context_tokens: int) -> None:
        self.cost_model, self.context = cost_model, context_tokens

    def seconds(self, num_tokens: int, num_reqs: int, has_chunk: bool) -> float:
        decodes = max(0, min(num_reqs - (1 if has_chunk else 0), num_tokens - (1 if has_chunk else 0)))
        rows = [(1, self.context)] * decodes
        if has_chunk or num_tokens > decodes:
            rows.append((num_tokens - decodes, 0))
        return self.cost_model.step_time(StepShape(rows, decodes + (1 if has_chunk else 0)))


def scheduler_load(scheduler: Scheduler) -> list[InFlight]:
    """What admission counts of every request the scheduler holds (running and waiting)."""
    load = []
    for r in [*scheduler.running, *scheduler.waiting]:
        started = r.num_output_tokens > 0
        load.append(InFlight(r.priority, r.arrival_time, 0 if started else r.num_prompt_tokens - r.num_computed_tokens,
                             max(r.max_output_tokens() - r.num_output_tokens, 0)))
    return load


class SimAdmission:
    """Admits or refuses each arriving request of a class with targets, as the server does; keeps what it
    predicted, to compare with what the simulation measured."""

    def __init__(self, service: ServiceClass, shape: EngineShape, step: CostModelStepTime) -> None:
        self.service, self.shape, self.step = service, shape, step
        self.predicted: dict[str, Prediction] = {}
        self.refused: list[Request] = []

    def __call__(self, request: Request, scheduler: Scheduler, now: float) -> bool:
        if request.priority != self.service.priority or not self.service.has_targets:
            return True  # another class (the batch's): admitted as it comes
        p = predict(scheduler_load(scheduler), request.priority, request.arrival_time, request.num_prompt_tokens,
                    request.max_output_tokens(), self.shape, self.step)
        if p is not None and not self.service.meets(p.ttft_s, p.tpot_s):
            self.refused.append(request)
            return False
        if p is not None:
            self.predicted[request.request_id] = p
        return True
