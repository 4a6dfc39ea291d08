"""Where an engine's time goes: wall-clock timers wrapped around the model's parts for one profiled run.

Benchmark-only instrumentation (it patches the classes while the context is open): linear layers (the lm_head
on its own), attention, norms + activation, the native decoder-layer stack (decode-sized steps run every layer
in one call, so their linear/attention/norm time is counted there, as one), sampling, the runner's step outside those (embedding, rope lookup,
input building, Python), and the engine outside the runner (scheduler, output processing).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict


class StepProfile:
    """``clock``: time.perf_counter (wall, default) or time.process_time (CPU time: steadier on a shared
    machine, and equal to wall time for a single-threaded engine that never waits)."""

    def __init__(self, engine, clock=time.perf_counter) -> None:
        self.engine, self.clock = engine, clock
        self.totals: dict[str, float] = defaultdict(float)
        self._undo: list = []
        self._wall0 = 0.0
        self.wall = 0.0

    def _wrap(self, owner, name: str, label, per_instance: bool = False) -> None:
        original = getattr(owner, name)
        totals, clock = self.totals, self.clock

        @functools.wraps(original)
        def timed(*args, **kwargs):
            t = clock()
            try:
                return original(*args, **kwargs)
            finally:
                key = label(args) if callable(label) else label
                totals[key] += clock() - t

        setattr(owner, name, timed)
        self._undo.append((owner, name, original, per_instance))

    def __enter__(self) -> StepProfile:
        from conveyor.layers import activation, norms
        from conveyor.layers.attention import cpu, native_cpu
        from conveyor.layers.linear import PackedLinear
        from conveyor.layers.quantized import QuantLinear
        from conveyor.models import decoder
        from conveyor.models.native_stack import NativeLayerStack

        eng = self.engine
        model = eng.model
        head = getattr(model, "lm_head", None)
        for linear in (PackedLinear, QuantLinear):  # float and quantized weights
            self._wrap(linear, "forward", lambda a: "lm_head" if a[0] is head else "linear")
        self._wrap(native_cpu.NativeCpuAttention, "forward",
                   lambda a: "attention" if a[0].meta.num_decodes == a[0].meta.num_reqs else "attention (prefill steps)")
        self._wrap(cpu.CpuAttention, "forward", "attention")
        self._wrap(norms.RMSNorm, "forward", "norm+act")
        self._wrap(decoder, "silu_and_mul", "norm+act")  # the name the decoder module calls
        self._wrap(NativeLayerStack, "run", "layer stack")
        self._wrap(eng.executor.sampler, "sample", "sampling", per_instance=True)
        self._wrap(eng.executor, "execute", "runner", per_instance=True)
        self._wrap(eng, "step", "engine", per_instance=True)
        del activation
        self._wall0 = self.clock()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = self.clock() - self._wall0
        for owner, name, original, per_instance in reversed(self._undo):
            if per_instance:
                delattr(owner, name)  # the instance attribute shadowed the class method
            else:
                setattr(owner, name, original)

    def summary(self) -> dict[str, float]:
        t = dict(self.totals)
        parts = ("linear", "lm_head", "attention", "attention (prefill steps)", "norm+act", "layer stack", "sampling")
        inside = sum(t.get(k, 0.0) for k in parts)
        out = {k: t.get(k, 0.0) for k in parts}
        out["runner other"] = t.get("runner", 0.0) - inside
        out["engine other"] = t.get("engine", 0.0) - t.get("runner", 0.0)
        out["outside step"] = self.wall - t.get("engine", 0.0)
        out["wall"] = self.wall
        return out
