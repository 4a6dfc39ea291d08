"""Cutting a step short for a request that outranks it: which steps an arrival may cut, and how far into one.

A step that holds only requests of lower priority than an arriving one (under priority scheduling: a Batch API
job's step while the interactive stream is idle) makes the arrival wait out its forward pass, up to a full token
budget's (hundreds of milliseconds on a CPU). The engine can stop such a step between decoder layers and drop it,
as if it never ran (``Scheduler.drop_cut_step``), so the arrival is scheduled at once; the cut step's tokens are
computed again later. These are the decisions; the engine (``engine.step_cut``) runs the mechanism.

Waste is bounded by ``max_fraction``: a step is cut only before that fraction of its layers has run, so no cut
throws away more than that fraction of one step, and a step nearly done finishes (the arrival waits less than the
rest of it). 1.0: cut before any layer but the first; 0: never cut.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from conveyor.core.outputs import SchedulerOutput
    from conveyor.core.scheduler import Scheduler


class StepCutPolicy(Protocol):
    """What the engine asks before running a step and when a request arrives during one."""

    def cut_threshold(self, step_priorities: Collection[int]) -> int | None:
        """The priority an arrival must beat (be lower than) to cut a step whose requests have these
        priorities; None: no arrival cuts it."""

    def cut_layers(self, num_layers: int) -> int:
        """A cut may stop the step before layer l only for 0 < l < this (0 or 1: never)."""

    def cuts(self, threshold: int | None, priority: int) -> bool:
        """Whether an arrival of ``priority`` cuts a step armed with ``threshold`` (``cut_threshold``'s)."""


class OutrankedStepCut:
    """Cut a step when a request arrives whose priority is better than every request's in it, before
    ``max_fraction`` of its layers ran."""

    def __init__(self, max_fraction: float) -> None:
        if not 0.0 <= max_fraction <= 1.0:
            raise ValueError(f"the step-cut fraction must be in [0, 1], got {max_fraction}")
        self.max_fraction = max_fraction

    def cut_threshold(self, step_priorities: Collection[int]) -> int | None:
        if not step_priorities or self.max_fraction == 0.0:
            return None
        return min(step_priorities)

    def cut_layers(self, num_layers: int) -> int:
        return math.ceil(num_layers * self.max_fraction)

    def cuts(self, threshold: int | None, priority: int) -> bool:
        return threshold is not None and priority < threshold


def cut_unsafe_reason(scheduler: Scheduler, out: SchedulerOutput) -> str | None:
    """Why the step ``out`` (just scheduled) may not be cut short and dropped (``Scheduler.drop_cut_step``), or None.

    Dropping a step is exact when nothing but its forward pass depends on it: the counts advance only in
    ``Scheduler.update``, the blocks stay for the redo, and what the step made findable is taken back. Not so for
    speculation (proposals and draft-model KV written at schedule time), KV eviction (blocks dropped at schedule
    time, scores expected in ``update``), a padded baseline's step, a pooling request (its result comes from the
    step), nor a prefix hit in the same step on a block the step made findable."""
    if scheduler.speculator is not None:
        return "speculative decoding"
    if scheduler.evictor is not None:
        return "KV eviction"
    if out.num_padding_tokens:
        return "a padded step"
    if any(scheduler.requests[rid].is_pooling for rid in out.num_scheduled_tokens):
        return "a pooling request"
    if scheduler.kv.step_published_shared():
        return "a prefix hit on a block this step makes findable"
    return None
