"""The baselines: static and dynamic batching, in the same scheduler as continuous batching.

A batch is a noun here. It forms once, runs until its last member finishes, and only then may the next batch
form. Everything such a system computes in vain is computed here too, and counted (``WastedWork``):

- prefill is padded to the batch's longest prompt: the executor computes that many extra tokens;
- a member that finishes is parked (``RequestStatus.PARKED``): it keeps its slot and keeps decoding (tokens
  computed, output discarded: idle-slot tokens) until the whole batch is done.

When a member is reported finished. Its user-visible finish is when its *own* output completes (the engine
returns it at that step, as a streaming server over a static batch would); only its slot and KV blocks stay
held until the batch drains. A non-streaming system (e.g. ``transformers``' ``generate``) returns all members at
the batch's end, so the latencies reported here for static and dynamic are a lower bound for such systems; the
throughput and the wasted work are the same either way.

Life of a batch::

    begin_step:  batch drained?   --yes-->  release the parked members, forget the batch
                 member preempted? --yes-->  release the parked members (they hold the blocks it waits for)
                 no batch, ready? --yes-->  start forming: every admission of this step joins
    end_step:    forming?         --yes-->  members := running; pad this step's prompts to the longest
    on_finished: a member finished  -->  PARK: it keeps its slot, decoding for nobody
"""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.core.config import SchedulerConfig
from conveyor.core.outputs import SchedulerOutput
from conveyor.core.policies.base import BasePolicy, OnFinish, WastedWork
from conveyor.core.request import Request, RequestStatus


class StaticBatchPolicy(BasePolicy):
    """Batches of ``max_num_seqs`` requests (or all waiting, when fewer), formed as soon as the last one drained."""

    name = "static"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.members: set[str] = set()  # ids of the current batch (empty: no batch)
        self.forming = False  # a batch forms in this step: every admission joins it

    def step_budget(self) -> int:
        # The whole padded batch is one forward pass: no token budget splits it.
        return self.config.max_num_seqs * (self.config.max_model_len or self.config.max_num_batched_tokens)

    def batch_ready(self, waiting: Sequence[Request], now: float) -> bool:
        """Whether a new batch may start now (static: whenever anyone waits)."""
        return True

    def begin_step(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> list[Request]:
        released: list[Request] = []
        if self.members and self._drained(running, waiting):
            released, self.members = list(running), set()  # the batch is done: every slot is freed
        elif self.members and any(r.request_id in self.members for r in waiting):
            # A preempted member waits to resume, and only admission can bring it back, which never preempts:
            # parked slots would keep its blocks (a slot parked at max_model_len holds them for good: a
            # livelock). Releasing a parked slot loses nothing; its user already has the output.
            released = [r for r in running if r.status is RequestStatus.PARKED]
        no_batch = not self.members and len(released) == len(running)
        self.forming = no_batch and bool(waiting) and self.batch_ready(waiting, now)
        return released

    def _drained(self, running: Sequence[Request], waiting: Sequence[Request]) -> bool:
        """Every member is parked, and none waits to resume after a preemption."""
        if any(r.status is not RequestStatus.PARKED for r in running):
            return False
        return not any(r.request_id in self.members for r in waiting)

    def admits(self, request: Request) -> bool:
        # Joining the batch being formed, or a preempted member resuming its slot; anyone else waits for the drain.
        return self.forming or request.request_id in self.members

    def end_step(self, out: SchedulerOutput, running: Sequence[Request]) -> WastedWork:
        if self.forming:
            self.forming = False
            self.members = {r.request_id for r in running}
        scheduled = out.num_scheduled_tokens
        # Pad this step's prefills to the longest one, as a padded [batch, max_len] tensor would compute.
        chunks = [scheduled[r.request_id] for r in out.scheduled_new_reqs]
        padding = max(chunks) * len(chunks) - sum(chunks) if len(chunks) > 1 else 0
        idle = sum(scheduled.get(r.request_id, 0) for r in running if r.status is RequestStatus.PARKED)
        return WastedWork(padding, idle)

    def on_finished(self, request: Request) -> OnFinish:
        return OnFinish.PARK

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        """Parked members first (releasing one loses nothing), then FCFS as for continuous batching."""
        parked = [r for r in candidates if r.status is RequestStatus.PARKED]
        return parked[-1] if parked else candidates[-1]


class DynamicBatchPolicy(StaticBatchPolicy):
    """Static batching whose batch starts when ``max_num_seqs`` requests wait, or when the oldest waiting request
    has waited ``max_wait_ms``, whichever comes first. Requests arriving meanwhile join the forming batch."""

    name = "dynamic"

    def batch_ready(self, waiting: Sequence[Request], now: float) -> bool:
        if len(waiting) >= self.config.max_num_seqs:
            return True
        oldest = min(r.arrival_time for r in waiting)
        return (now - oldest) * 1000.0 >= self.config.max_wait_ms
