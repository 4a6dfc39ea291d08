"""The baselines: static and dynamic batching, in the same scheduler as continuous batching.

A batch is a noun here. It forms once, runs until its last member finishes, and only then may the next batch
form. Everything such a system computes in vain is computed here too, and counted:

- prefill is padded to the batch's longest prompt: ``SchedulerOutput.num_padding_tokens`` tells the executor to
  compute that many extra tokens;
- a member that finishes keeps its slot and keeps decoding ("idle slot": tokens computed, output discarded,
  counted in ``num_idle_slot_tokens``) until the whole batch is done.

When a member is reported finished. Its user-visible finish is when its *own* output completes (the engine
returns it at that step, as a streaming server over a static batch would); only its slot and KV blocks stay
held until the batch drains. A non-streaming system (e.g. ``transformers``' ``generate``) returns all members at
the batch's end, so the latencies reported here for static and dynamic are a lower bound for such systems; the
throughput and the wasted work are the same either way.

Life of a batch::

    begin_step: batch drained?  --yes-->  release parked slots, forget members
    may_admit:  no batch?       --ready-->  start forming: every admission of this step joins
    end_step:   forming?        --yes-->  members := running; pad their prompts; stop forming
    park_finished: a member finished  -->  it stays in ``running`` as an idle slot
"""

from __future__ import annotations

from conveyor.core.config import SchedulerConfig
from conveyor.core.policy import ContinuousPolicy
from conveyor.core.request import Request, RequestStatus


class StaticBatchPolicy(ContinuousPolicy):
    """Batches of ``max_num_seqs`` requests (or all waiting, when fewer), formed as soon as the last one drained."""

    name = "static"
    holds_finished_slots = True

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.members: set[str] = set()  # ids of the current batch (empty: no batch)
        self.forming = False  # a batch is being formed in this schedule() call

    # ---- batch formation --------------------------------------------------------------------------------
    def step_budget(self) -> int:
        # The whole padded batch is one forward pass: no token budget splits it.
        return self.config.max_num_seqs * (self.config.max_model_len or self.config.max_num_batched_tokens)

    def batch_ready(self, waiting: list[Request], now: float) -> bool:
        """Whether a new batch may start now (static: whenever anyone waits)."""
        return True

    def may_admit(self, waiting: list[Request], running: list[Request], now: float) -> bool:
        if self.forming or waiting[0].request_id in self.members:
            return True  # joining the batch being formed, or a preempted member resuming its slot
        if self.members or running:
            return False  # a batch is in flight: the next one waits until it drains
        if not self.batch_ready(waiting, now):
            return False
        self.forming = True
        return True

    def end_step(self, scheduler, out) -> None:
        if self.forming:
            self.forming = False
            self.members = {r.request_id for r in scheduler.running}
        # Pad this step's prefills to the longest one, as a padded [batch, max_len] tensor would compute.
        chunks = [out.num_scheduled_tokens[r.request_id] for r in out.scheduled_new_reqs]
        if len(chunks) > 1:
            out.num_padding_tokens += max(chunks) * len(chunks) - sum(chunks)

    # ---- finished members ---------------------------------------------------------------------------------
    def park_finished(self, scheduler, request: Request, status: RequestStatus, now: float) -> None:
        """The member is finished for its user (status and finish time set now) but keeps its slot."""
        request.status = status
        request.times.finished = now
        request.idle_slot = True

    def begin_step(self, scheduler, now: float) -> None:
        if not self.members:
            return
        if any(not r.idle_slot for r in scheduler.running):
            return
        if any(r.request_id in self.members for r in scheduler.waiting):
            return  # a preempted member still has work to do
        for request in list(scheduler.running):
            scheduler.release_slot(request)
        self.members = set()

    def choose_victim(self, candidates: list[Request]) -> Request:
        """Idle slots first (releasing one loses nothing), then FCFS as for continuous batching."""
        idle = [r for r in candidates if r.idle_slot]
        return idle[-1] if idle else candidates[-1]


class DynamicBatchPolicy(StaticBatchPolicy):
    """Static batching whose batch starts when ``max_num_seqs`` requests wait, or when the oldest waiting request
    has waited ``max_wait_ms``, whichever comes first. Requests arriving meanwhile join the forming batch."""

    name = "dynamic"

    def batch_ready(self, waiting: list[Request], now: float) -> bool:
        if len(waiting) >= self.config.max_num_seqs:
            return True
        oldest = min(r.arrival_time for r in waiting)
        return (now - oldest) * 1000.0 >= self.config.max_wait_ms


def make_batch_policy(config: SchedulerConfig):
    """The baseline policy named by ``config.policy`` ("static" or "dynamic")."""
    if config.policy == "static":
        return StaticBatchPolicy(config)
    if config.policy == "dynamic":
        return DynamicBatchPolicy(config)
    raise ValueError(f"unknown batch policy {config.policy!r}")
