"""Fit a device's efficiencies and overheads to measured step times (``conveyor sim calibrate``). PURE PYTHON.

The roofline's time is max(compute, memory) per op plus three overheads, so it is linear in the overheads but
not in the efficiencies. The fit searches the three efficiencies (GEMM, attention, memory) on a log grid and
then refines them coordinate-wise; for each candidate the overheads (per step, per request, per token) are the
non-negative weighted least-squares solution. The error is relative (step times span three decades):
``sum(((predicted - measured) / measured) ** 2)``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from conveyor.core.linalg import solve
from conveyor.sim.cost_model import RooflineCostModel, StepShape
from conveyor.sim.hardware import Hardware
from conveyor.sim.model_specs import ModelSpec

EFFICIENCIES = ("matmul_efficiency", "attention_efficiency", "memory_efficiency")
OVERHEADS = ("step_overhead_s", "per_request_overhead_s", "per_token_overhead_s")
GRID = [0.02 * (1.5 ** k) for k in range(12)]  # 0.02 .. 1.7 of the measured peak


@dataclass
class FitReport:
    hardware: Hardware
    rms_rel_error: float
    max_rel_error: float
    num_points: int

    def to_dict(self) -> dict:
        return {"rms_rel_error": self.rms_rel_error, "max_rel_error": self.max_rel_error,
                "num_points": self.num_points}


def nonnegative_least_squares(features: list[list[float]], targets: list[float], weights: list[float]
                              ) -> list[float]:
    """min sum w (f . x - y)^2 over x >= 0, by trying every subset of free coefficients (there are three)."""
    k = len(features[0])
    best, best_err = [0.0] * k, sum(w * y * y for w, y in zip(weights, targets))
    for size in range(1, k + 1):
        for subset in itertools.combinations(range(k), size):
            a = [[sum(w * f[i] * f[j] for f, w in zip(features, weights)) for j in subset] for i in subset]
            b = [sum(w * f[i] * y for f, w, y in zip(features, weights, targets)) for i in subset]
            x = solve(a, b)
            if x is None or min(x) < 0:
                continue
            full = [0.0] * k
            for i, v in zip(subset, x):
                full[i] = v
            err = sum(w * (sum(fi * xi for fi, xi in zip(f, full)) - y) ** 2
                      for f, w, y in zip(features, weights, targets))
            if err < best_err:
                best, best_err = full, err
    return best


class _Problem:
    """The measured points with their op counts computed once (they do not depend on the efficiencies)."""

    def __init__(self, spec: ModelSpec, base: Hardware, points: list[tuple[StepShape, float]]) -> None:
        if len(points) < 6:
            raise ValueError(f"need at least 6 measured steps to fit, got {len(points)}")
        self.spec, self.base = spec, base
        model = RooflineCostModel(spec, base)
        self.ops = [model.op_counts(shape) for shape, _ in points]
        self.features = [[1.0, float(shape.num_reqs), float(shape.num_tokens)] for shape, _ in points]
        self.measured = [seconds for _, seconds in points]
        self.weights = [1.0 / (y * y) for y in self.measured]

    def op_seconds(self, effs: tuple[float, float, float]) -> list[float]:
        model = RooflineCostModel(self.spec, self.base.with_overrides(**dict(zip(EFFICIENCIES, effs))))
        return [model.op_seconds(o) for o in self.ops]

    def evaluate(self, effs: tuple[float, float, float]) -> tuple[float, list[float]]:
        ops = self.op_seconds(effs)
        residual = [y - t for y, t in zip(self.measured, ops)]
        overheads = nonnegative_least_squares(self.features, residual, self.weights)
        err = sum(w * (t + sum(f * x for f, x in zip(feat, overheads)) - y) ** 2
                  for t, feat, w, y in zip(ops, self.features, self.weights, self.measured))
        return err, overheads


def fit_hardware(spec: ModelSpec, base: Hardware, points: list[tuple[StepShape, float]]) -> FitReport:
    """The ``base`` hardware (its measured peaks) with efficiencies and overheads fitted to ``points``."""
    problem = _Problem(spec, base, points)
    best = min(itertools.product(GRID, GRID, GRID), key=lambda e: problem.evaluate(e)[0])
    err = problem.evaluate(best)[0]
    step = 1.5
    while step > 1.01:  # coordinate refinement: shrink the multiplicative step until nothing improves
        improved = False
        for i in range(3):
            for factor in (step, 1 / step):
                trial = tuple(v * factor if j == i else v for j, v in enumerate(best))
                trial_err = problem.evaluate(trial)[0]
                if trial_err < err:
                    best, err, improved = trial, trial_err, True
        if not improved:
            step = math.sqrt(step)
    err, overheads = problem.evaluate(best)
    fitted = base.with_overrides(**dict(zip(EFFICIENCIES, best)), **dict(zip(OVERHEADS, overheads)))
    model = RooflineCostModel(spec, fitted)
    rel = [(model.step_time(shape) - y) / y for shape, y in points]
    return FitReport(fitted, math.sqrt(sum(r * r for r in rel) / len(rel)), max(abs(r) for r in rel), len(rel))
