"""Priority scheduling (vLLM's ``--scheduling-policy priority``): a request's ``priority`` orders it, lower first,
ties by arrival; under KV pressure the lowest-priority running request is preempted first; and a waiting request
that outranks running ones takes their seats, blocks and step budget at the next step (they are preempted, or their
prompt chunks wait), so work at the lowest priority (the Batch API's lines) fills only what higher priorities leave.

The decisions, as ``PriorityOrder`` adds them to a batching policy (continuous or chunked):

==================  ===============================================================================================
``waiting_queue``   the waiting requests ordered by (priority, arrival); a preempted request goes back in its place
``order_running``   the running requests in priority order, so the lowest are scheduled last (and are the victims
                    when blocks run out)
``choose_victim``   the lowest priority; among equals the most recently admitted (FCFS's rule)
``yield_to_waiting`` which running requests make room for waiting ones that outrank them: preempted for a seat or
                    blocks, held (no tokens this step) when they are prompt chunks that would spend the budget; and,
                    with ``priority_step_slack``, how many tokens those below the step's best priority may add
                    to it (at most that fraction of its measured time)
==================  ===============================================================================================

With every priority equal this is first come, first served: the same queue order, victims and steps.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence

from conveyor.core.policies.base import NO_YIELD, Room, StepYield
from conveyor.core.policies.continuous import ChunkedPolicy, ContinuousPolicy
from conveyor.core.request import Request
from conveyor.core.sampling_params import PRIORITY_MAX

# The Batch API's lines run at the lowest priority there is (a client asking for it too shares it, by arrival).
BATCH_PRIORITY = PRIORITY_MAX


class PriorityWaitingQueue:
    """Waiting requests ordered by (priority, arrival, insertion): the deque operations the scheduler uses, where
    ``append`` and ``appendleft`` both put a request in its place (bisection: a list insert moves pointers in C,
    microseconds for thousands of waiting requests)."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, float, int]] = []
        self._items: list[Request] = []
        self._seq = itertools.count()

    def append(self, request: Request) -> None:
        self._insert((request.priority, request.arrival_time, next(self._seq)), request)

    def appendleft(self, request: Request) -> None:
        """A preempted request: back in its place, ahead of the requests of its priority and arrival time (as
        first come, first served puts it at the head)."""
        self._insert((request.priority, request.arrival_time, -next(self._seq)), request)

    def _insert(self, key: tuple[int, float, int], request: Request) -> None:
        at = bisect.bisect(self._keys, key)
        self._keys.insert(at, key)
        self._items.insert(at, request)

    def popleft(self) -> Request:
        del self._keys[0]
        return self._items.pop(0)

    def remove(self, request: Request) -> None:
        at = self._items.index(request)
        del self._keys[at], self._items[at]

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


class PriorityOrder:
    """The priority decisions, mixed into a batching policy (which gives ``config``, ``step_budget`` and
    ``prefill_chunk``)."""

    def waiting_queue(self) -> PriorityWaitingQueue:
        return PriorityWaitingQueue()

    def order_running(self, requests: list[Request]) -> list[Request]:
        return sorted(requests, key=lambda r: r.priority)  # stable: decodes before prompt chunks within a priority

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        lowest = max(r.priority for r in candidates)
        return next(r for r in reversed(candidates) if r.priority == lowest)

    def yield_to_waiting(self, running: Sequence[Request], waiting: Sequence[Request], room: Room) -> StepYield:
        """Room for the requests that outrank others: ``_make_room`` for waiting ones; then, with a step slack
        (``SchedulerConfig.priority_step_slack``) and a measured step cost, ``_slack_caps`` on the tokens of every
        request below the best priority of the step (running, or admitted into it now)."""
        preempt, caps, incoming = self._make_room(running, waiting, room)
        kept = [r for r in running if r not in preempt]
        admit_cap = None
        cost, slack = room.step_cost, self.config.priority_step_slack
        if slack is not None and cost is not None and (kept or incoming):
            admit_cap = self._slack_caps(kept, incoming, caps, cost, slack)
        if not preempt and not caps and admit_cap is None:
            return NO_YIELD
        return StepYield(preempt, caps, admit_cap)

    def _make_room(self, running: Sequence[Request], waiting: Sequence[Request],
                   room: Room) -> tuple[list[Request], dict[str, int], list[tuple[Request, int]]]:
        """Room for the waiting requests that outrank running ones, in queue order, as far as this step's budget
        reaches: a seat and the blocks of its first chunk each, taken from the lowest-priority running requests
        (newest first) while the free ones do not suffice; and every running prompt below the best waiting
        priority is held this step (a cap of 0), so that its chunk does not spend the budget first. The block
        counts are estimates (a request's blocks shared with the prefix cache do not come free); the scheduler's
        allocation is the exact check. (The preempted, the caps, and the waiting requests made room for, each with
        its first chunk's tokens.)"""
        if not waiting or not running:
            return [], {}, []
        best = waiting[0].priority
        if best >= max(r.priority for r in running):
            return [], {}, []  # nobody waiting outranks anyone running
        victims = sorted(running, key=lambda r: r.priority)  # the pool to preempt from, lowest priority last
        held = {r.request_id for r in running if r.priority > best and r.num_tokens - r.num_computed_tokens > 1}
        seats, blocks, budget = room.free_seats, room.free_blocks, self.step_budget()
        budget -= sum(1 for r in running if r.request_id not in held)  # decodes that still run
        preempt: list[Request] = []
        incoming: list[tuple[Request, int]] = []
        for request in waiting:
            if not victims or request.priority >= victims[-1].priority:
                break  # the rest of the queue ranks no better: what is left to it, it gets by the usual rules
            chunk = self.prefill_chunk(request.num_tokens - request.num_computed_tokens, budget)
            if chunk <= 0:
                break
            need = -(-chunk // room.block_size)
            while (seats < 1 or blocks < need) and victims and victims[-1].priority > request.priority:
                victim = victims.pop()
                preempt.append(victim)
                held.discard(victim.request_id)
                seats += 1
                blocks += -(-victim.num_computed_tokens // room.block_size)
            if seats < 1 or blocks < need:
                break
            seats, blocks, budget = seats - 1, blocks - need, budget - chunk
            incoming.append((request, chunk))
        return preempt, dict.fromkeys(held, 0), incoming

    def _slack_caps(self, running: list[Request], incoming: list[tuple[Request, int]], caps: dict[str, int],
                    cost: tuple[float, float, float], slack: float) -> tuple[int, int]:
        """Cap (in ``caps``) the tokens of the running requests below the step's best priority so that they add at
        most ``slack`` of the step's time without them, by the measured ``cost`` line (fixed + per token + a prompt
        chunk's own); decodes first, then prompt chunks. The step's best priority counts the waiting requests
        ``_make_room`` admits into it (``incoming``, with their first chunks): the step that admits an interactive
        request is an interactive step, and the batch's decodes add to it no more than to the next. Returns what is
        left for waiting requests of a worse priority, (the best priority, tokens)."""
        best = min(r.priority for r in itertools.chain(running, (r for r, _ in incoming)))
        fixed, per_token, chunk_cost = cost
        behind = [(r, min(r.num_tokens - r.num_computed_tokens, self.step_budget())) for r in running
                  if r.priority == best] + [(r, chunk) for r, chunk in incoming if r.priority == best]
        tokens = sum(n for _, n in behind)
        top_chunk = any(n > 1 for _, n in behind)
        spare = slack * (fixed + per_token * tokens + (chunk_cost if top_chunk else 0.0))
        lower = sorted((r for r in running if r.priority > best and caps.get(r.request_id) != 0),
                       key=lambda r: (r.priority, r.num_tokens - r.num_computed_tokens > 1))
        chunk_paid = top_chunk
        for r in lower:
            behind = r.num_tokens - r.num_computed_tokens
            extra = 0.0 if chunk_paid or behind <= 1 else chunk_cost
            caps[r.request_id] = _tokens_within(spare - extra, per_token, behind)
            if caps[r.request_id]:
                spare -= extra + per_token * caps[r.request_id]
                chunk_paid = chunk_paid or behind > 1
        return best, _tokens_within(spare - (0.0 if chunk_paid else chunk_cost), per_token, self.step_budget())


def _tokens_within(seconds: float, per_token: float, most: int) -> int:
    """How many tokens (at most ``most``) fit in ``seconds`` at ``per_token`` seconds each: none when no time is
    left; all when the measured line gives tokens no cost (a fit over steps of one size)."""
    if seconds <= 0:
        return 0
    if per_token <= 0:
        return most
    return max(0, min(most, int(seconds / per_token)))


class PriorityContinuousPolicy(PriorityOrder, ContinuousPolicy):
    """Orca-style continuous batching, in priority order."""


class PriorityChunkedPolicy(PriorityOrder, ChunkedPolicy):
    """Chunked continuous batching, in priority order."""


WITH_PRIORITY = {"continuous": PriorityContinuousPolicy, "chunked": PriorityChunkedPolicy}
