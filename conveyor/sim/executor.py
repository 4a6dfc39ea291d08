"""``SimExecutor``: the executor protocol (``execute(SchedulerOutput) -> ModelOutput``) on a cost model. PURE PYTHON.

It keeps what the real runner keeps per request that matters to cost and sampling (how many tokens it holds),
so it knows, as the runner does, which rows sample: a request samples when this step brings its computed tokens
up to every token the executor holds for it. Sampled tokens are a fixed id: a simulated request runs to its
``max_tokens`` (the workload's output length, ``ignore_eos``), so the values never matter to the schedule.
"""

from __future__ import annotations

from conveyor.core.outputs import ModelOutput, SchedulerOutput
from conveyor.sim.cost_model import CostModel, StepCost, StepShape

SIM_TOKEN_ID = 0


class SequenceTracker:
    """Per-request token counts on the executor side, mirrored from the SchedulerOutputs it is shown."""

    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}

    def shape_of(self, so: SchedulerOutput) -> tuple[StepShape, list[str]]:
        """The step's shape, and the ids of the requests that sample (their count grows by one token each)."""
        held = self.num_tokens
        for rid in so.finished_req_ids:
            held.pop(rid, None)
        for rid in so.preempted_req_ids:
            held.pop(rid, None)
        scheduled = so.num_scheduled_tokens
        rows: list[tuple[int, int]] = []
        samplers: list[str] = []
        for new in so.scheduled_new_reqs:
            rid = new.request_id
            held[rid] = len(new.token_ids)
            q = scheduled[rid]
            rows.append((q, new.num_computed_tokens))
            if new.num_computed_tokens + q == held[rid]:
                samplers.append(rid)
        for cached in so.scheduled_cached_reqs:
            rid = cached.request_id
            q = scheduled[rid]
            # attention reads the keys the request holds: under KV eviction, its KV slots, not its positions
            rows.append((q, cached.num_computed_tokens - cached.num_evicted_tokens))
            if cached.num_computed_tokens + q == held[rid]:
                samplers.append(rid)
        for rid in samplers:
            held[rid] += 1
        return StepShape(rows, len(samplers), so.num_padding_tokens), samplers


class SimExecutor:
    """Returns a ``ModelOutput`` for each step and prices the step with ``cost_model`` (``last_cost``)."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self.tracker = SequenceTracker()
        self.last_cost: StepCost | None = None

    def step(self, so: SchedulerOutput) -> tuple[ModelOutput, StepCost]:
        """One forward pass: the sampled tokens and what the pass cost (seconds on the virtual clock)."""
        shape, samplers = self.tracker.shape_of(so)
        cost = self.cost_model.step_cost(shape) if shape.rows or shape.num_padding_tokens else StepCost(0.0)
        self.last_cost = cost
        return ModelOutput(sampled_token_ids=dict.fromkeys(samplers, SIM_TOKEN_ID)), cost

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        """The executor protocol; the step's cost is left in ``last_cost``."""
        return self.step(so)[0]
