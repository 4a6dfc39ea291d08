"""One engine instance of a simulated cluster: its role, its real scheduler and executor, what reached it. PURE PYTHON.

``sim/cluster.py`` steps instances on one clock; an ``Instance`` holds what belongs to one engine: its
``core.Scheduler`` (and KV manager), its ``SimExecutor`` (the cost model of its TP), its queue of deliveries not
yet added, and on a decode instance the hand-offs waiting for room and the transfers in flight to it. The
routing loads (``pending_prefill_tokens``, ``num_requests``) and the hand-off gate (``room``) are read here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from conveyor.core.block_pool import cdiv
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler
from conveyor.sim.executor import SimExecutor
from conveyor.sim.held_kv import HeldKVManager
from conveyor.sim.loop import StepObserver

COLOCATED, PREFILL, DECODE = "colocated", "prefill", "decode"


@dataclass(frozen=True)
class Delivery:
    """A request as it reached an instance: enough to replay that instance alone (the schedule test)."""

    time: float
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    max_tokens: int


class Instance:
    """One engine of the cluster: ``role`` (colocated, prefill or decode), its scheduler, executor and TP."""

    def __init__(self, name: str, role: str, scheduler: Scheduler, executor: SimExecutor, tp: int = 1,
                 observer: StepObserver | None = None) -> None:
        if role not in (COLOCATED, PREFILL, DECODE):
            raise ValueError(f"unknown instance role {role!r}")
        if role == PREFILL and not isinstance(scheduler.kv, HeldKVManager):
            raise ValueError("a prefill instance's KV manager must be a HeldKVManager (its blocks outlive the request)")
        # A prefill instance's KV manager, which holds a finished request's blocks until its KV has left
        self.held: HeldKVManager | None = scheduler.kv if role == PREFILL else None
        if role != COLOCATED and scheduler.kv.layout != "paged":
            raise ValueError("disaggregated instances need the paged KV layout (block counts for hand-offs)")
        self.name, self.role, self.scheduler, self.executor, self.tp, self.observer = (
            name, role, scheduler, executor, tp, observer)
        self.inbox: list[Request] = []  # delivered, joining the queue at the next step
        self.handoffs: list = []  # of sim.cluster records  # decode side: prefills done, waiting for room to transfer
        self.num_inbound = 0  # decode side: transfers in flight to it
        self.inbound_blocks = 0  # their blocks
        self.sleeping = True
        self.in_step: tuple | None = None
        self.idle_polls = 0
        self.num_steps = 0
        self.busy_s = 0.0
        self.deliveries: list[Delivery] = []

    def deliver(self, request: Request, now: float) -> None:
        self.inbox.append(request)
        self.deliveries.append(Delivery(now, request.request_id, list(request.prompt_token_ids),
                                        list(request.output_token_ids), request.num_computed_tokens,
                                        request.sampling_params.max_tokens))

    def pending_prefill_tokens(self) -> int:
        s = self.scheduler
        return sum(r.num_tokens - r.num_computed_tokens for r in itertools.chain(s.waiting, s.running, self.inbox))

    def num_requests(self) -> int:
        s = self.scheduler
        return s.num_running + s.num_waiting + len(self.inbox) + len(self.handoffs) + self.num_inbound

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.scheduler.kv.block_size)

    def room(self) -> int:
        """Free blocks not yet promised to requests on their way here or waiting to be admitted."""
        s = self.scheduler
        promised = self.inbound_blocks + sum(self.blocks_for(r.num_tokens + 1)
                                             for r in itertools.chain(s.waiting, self.inbox))
        return s.kv.num_free_blocks - promised
