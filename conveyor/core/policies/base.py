"""What a scheduling policy is: the questions the scheduler asks it, and the decisions it hands back.

Mechanism (the token budget, the KV manager, preemption, the queues) lives in ``scheduler.py``; decisions live in
a policy. A policy never touches the scheduler: it reads the queues it is shown and returns values that the
scheduler applies. It may keep state of its own (a static batch's members).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

from conveyor.core.config import SchedulerConfig
from conveyor.core.outputs import SchedulerOutput
from conveyor.core.request import Request


class OnFinish(enum.Enum):
    """What becomes of a request that finished for its user."""

    RETIRE = "retire"  # leave the batch now; its blocks are freed
    PARK = "park"  # keep the slot and keep computing (output discarded) until the policy releases it


class WastedWork(NamedTuple):
    """Work a step does on purpose for nobody: pad tokens the executor must add, and how many of the scheduled
    tokens belong to parked requests."""

    num_padding_tokens: int = 0
    num_idle_slot_tokens: int = 0


NO_WASTE = WastedWork()


class Room(NamedTuple):
    """What a step has free before it schedules anyone: seats in the running batch, KV blocks, and their size; and
    the step's cost as the scheduler measured it, (fixed seconds, seconds per token, a prompt chunk's seconds)
    (``speculative.StepCostModel``; None: not asked for, or not known yet)."""

    free_seats: int
    free_blocks: int
    block_size: int
    step_cost: tuple[float, float, float] | None = None


class StepYield(NamedTuple):
    """Running requests that make room for others this step: ``preempt`` lose their blocks and go back to the queue
    (recompute); ``caps`` (id -> tokens) compute at most that many tokens this step (0: none, their blocks kept);
    ``admit_cap`` (priority, tokens): waiting requests of a worse priority than that may be admitted with at most
    that many tokens in all this step."""

    preempt: list[Request]
    caps: dict[str, int] | None = None
    admit_cap: tuple[int, int] | None = None


NO_YIELD = StepYield([])


class WaitingQueue(Protocol):
    """The waiting requests in the order they are admitted: the deque operations the scheduler uses
    (``appendleft``: a preempted request going back)."""

    def append(self, request: Request) -> None: ...

    def appendleft(self, request: Request) -> None: ...

    def popleft(self) -> Request: ...

    def remove(self, request: Request) -> None: ...

    def __getitem__(self, index: int) -> Request: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class SchedulingPolicy(Protocol):
    """The decisions of one batching strategy. ``name`` is its key in ``policies.POLICIES``."""

    name: str

    def step_budget(self) -> int:
        """How many tokens one step may compute."""

    def prefill_chunk(self, remaining: int, budget: int) -> int:
        """How many of a prompt's ``remaining`` tokens to compute now, with ``budget`` tokens left (0: not now)."""

    def begin_step(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> list[Request]:
        """Called first in every step. Returns the parked requests to release now (their blocks are freed)."""

    def admits(self, request: Request) -> bool:
        """Whether the head of the waiting queue may join the batch in this step (a question: changes nothing)."""

    def end_step(self, out: SchedulerOutput, running: Sequence[Request]) -> WastedWork:
        """Called last in every step, with what was scheduled. Returns the work the step wastes on purpose."""

    def on_finished(self, request: Request) -> OnFinish:
        """Retire or park a request that just finished for its user."""

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        """The running request to preempt when blocks run out (``candidates`` in admission order)."""

    def waiting_queue(self) -> WaitingQueue:
        """A new, empty waiting queue: its order is the order of admission."""

    def order_running(self, requests: list[Request]) -> list[Request]:
        """The order in which running requests (decodes, then prompt chunks) get their tokens this step: the last
        are the first victims when blocks run out."""

    def yield_to_waiting(self, running: Sequence[Request], waiting: Sequence[Request], room: Room) -> StepYield:
        """Called before running requests are scheduled: which of them make room for waiting ones this step."""


class BasePolicy:
    """The neutral defaults every policy starts from: each prompt whole in the step it joins, no step hooks, no
    waste, a finished request retires, first come first served (queue order, preemption, nobody yields). A policy overrides only the decisions it changes
    (``ChunkedPolicy`` the budget and the chunking; the baselines their batch life)."""

    name = "base"

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def step_budget(self) -> int:
        # A whole prompt must always fit, so the budget is at least the model's context.
        return max(self.config.max_num_batched_tokens, self.config.max_model_len or 0)

    def prefill_chunk(self, remaining: int, budget: int) -> int:
        return remaining if remaining <= budget else 0

    def begin_step(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> list[Request]:
        return []

    def admits(self, request: Request) -> bool:
        return True

    def end_step(self, out: SchedulerOutput, running: Sequence[Request]) -> WastedWork:
        return NO_WASTE

    def on_finished(self, request: Request) -> OnFinish:
        return OnFinish.RETIRE

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        """FCFS: the most recently admitted request loses its blocks first."""
        return candidates[-1]

    def waiting_queue(self) -> WaitingQueue:
        """FCFS: arrival order; a preempted request goes back to the head."""
        return deque()

    def order_running(self, requests: list[Request]) -> list[Request]:
        return requests

    def yield_to_waiting(self, running: Sequence[Request], waiting: Sequence[Request], room: Room) -> StepYield:
        """FCFS: a waiting request waits for room; nobody running gives any up for it."""
        return NO_YIELD
