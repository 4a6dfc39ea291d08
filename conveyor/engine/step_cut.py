"""Steps an arriving request may cut short: the engine's half of ``core.policies.step_cut``.

Before each forward pass the engine ``arm``s the cutter with the step (the policy's threshold, the scheduler's
safety check); the thread that reads requests (the engine core process's input thread) ``offer``s each arrival's
priority; one that outranks every request in the armed step raises the runner's flag word
(``models.step_cut.CutFlag``), and the forward stops at its next layer boundary, in Python or in the native layer
stack, raising ``StepCut``. ``run`` then drops the step (``Scheduler.drop_cut_step``) and the engine runs the next round
of commands, which admits the arrival. Arming, offering and disarming hold one lock, so a late offer never leaves
the flag up for the next step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.core.outputs import ModelOutput, SchedulerOutput
from conveyor.core.policies.step_cut import OutrankedStepCut, StepCutPolicy, cut_unsafe_reason
from conveyor.core.scheduler import Scheduler
from conveyor.models.step_cut import CutFlag, StepCut


@dataclass
class StepCutCounts:
    """Cumulative: steps armed (cuttable), steps cut, and what the cut ones had scheduled and run."""

    armed: int = 0
    cut: int = 0
    cut_tokens: int = 0  # tokens the cut steps had scheduled (computed again later)
    cut_seconds: float = 0.0  # the cut steps' time from schedule to the cut (work thrown away)
    cut_native: int = 0  # of the cuts, inside the native layer stack
    not_cut: dict[str, int] | None = None  # why a step was not armed (the scheduler's reason) -> steps


class StepCutter:
    """Arms ``flag`` for the steps ``policy`` lets an arrival cut (see the module doc)."""

    def __init__(self, flag: CutFlag, policy: StepCutPolicy, num_layers: int) -> None:
        self.flag, self.policy, self.num_layers = flag, policy, num_layers
        self._lock = threading.Lock()
        self._threshold: int | None = None
        self._best_offered: int | None = None  # the best priority offered since the step's scheduling began
        self.counts = StepCutCounts(not_cut={})
        self.on_armed = None  # tests: called after a step is armed (e.g. to offer an arrival at a chosen step)

    @classmethod
    def build(cls, scheduling_policy: str, max_fraction: float, flag: CutFlag | None,
              num_layers: int) -> StepCutter | None:
        """The cutter of an engine (None: nothing outranks anything, cutting is off, or the runner has no flag)."""
        policy = OutrankedStepCut(max_fraction)
        if scheduling_policy != "priority" or flag is None or policy.cut_layers(num_layers) < 2:
            return None
        return cls(flag, policy, num_layers)

    def begin(self) -> None:
        """A step's scheduling begins: arrivals offered from now on count for it."""
        with self._lock:
            self._best_offered = None

    def arm(self, out: SchedulerOutput, scheduler: Scheduler) -> bool:
        """Make the scheduled step ``out`` cuttable, if the policy and the scheduler allow; whether it is."""
        threshold = self.policy.cut_threshold([scheduler.requests[rid].priority for rid in out.num_scheduled_tokens])
        if threshold is None:
            return False
        why = cut_unsafe_reason(scheduler, out)
        if why is not None:
            self.counts.not_cut[why] = self.counts.not_cut.get(why, 0) + 1
            return False
        with self._lock:
            self._threshold = threshold
            self.flag.cut_layers = self.policy.cut_layers(self.num_layers)
            if self._best_offered is not None and self.policy.cuts(threshold, self._best_offered):
                self.flag.raise_()  # it arrived while the step was being scheduled: cut at the first boundary
        self.counts.armed += 1
        if self.on_armed is not None:
            self.on_armed(self)
        return True

    def run(self, out: SchedulerOutput, scheduler: Scheduler, forward: Callable[[], ModelOutput],
            started: float) -> ModelOutput | None:
        """``forward()`` of the scheduled step ``out``, armed if it may be cut; None when an arrival cut it short
        (the step is then dropped as if it never ran: ``Scheduler.drop_cut_step``)."""
        armed = self.arm(out, scheduler)
        try:
            return forward()
        except StepCut as cut:
            scheduler.drop_cut_step(out)
            self.record_cut(out, time.monotonic() - started, cut.native)
            return None
        finally:
            if armed:
                self.disarm()

    def offer(self, priority: int) -> None:
        """A request of ``priority`` arrived (any thread): cut the armed step if it outranks every request in it."""
        with self._lock:
            if self._best_offered is None or priority < self._best_offered:
                self._best_offered = priority
            if self.policy.cuts(self._threshold, priority):
                self.flag.raise_()

    def disarm(self) -> None:
        """The step's forward returned or was cut: no offer reaches the next one's flag."""
        with self._lock:
            self._threshold = None
            self.flag.cut_layers = 0
            self.flag.clear()

    def record_cut(self, out: SchedulerOutput, seconds: float, native: bool) -> None:
        counts = self.counts
        counts.cut += 1
        counts.cut_tokens += out.total_num_scheduled_tokens
        counts.cut_seconds += seconds
        counts.cut_native += int(native)
