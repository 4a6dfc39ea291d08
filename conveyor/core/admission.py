"""SLO-aware admission: service classes with TTFT / TPOT targets, and a prediction of a request's TTFT and TPOT
from a step cost model and the requests already in flight, so that a request that cannot meet its class's target is
refused (or moved to a lower class) at once instead of admitted to miss it (Mooncake's early rejection). PURE PYTHON.

The prediction is first-order, from what chunked prefill does with a step's token budget ``B``:

- the prompts served before the request (those of a better priority, and of its own priority that arrived first)
  and its own prompt go through the budget left by the ``D`` decoding requests, ``B - D`` tokens a step, so its
  first token comes after ``ceil((ahead + prompt) / (B - D))`` steps, full ones but the last, plus what is left of
  the step running now; waiting for a seat (``max_num_seqs`` taken by requests it does not outrank) adds the
  steps until the nearest of them finishes;
- each of its later tokens takes one step: a full one while prompts are left to compute (every priority's: work
  of a lower priority fills what the higher leave), else a step of the ``D + 1`` decodes.

Step times come from a ``StepTime``: in the server the engine's own steps fitted online (``OnlineStepTime`` over
``core.speculative.StepCostModel``, the model speculation fits), in the simulator its calibrated roofline
(``sim.cost_model``). Targets are per request: its TTFT under ``ttft_s`` and its mean time per output token after
the first under ``tpot_s``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from conveyor.core.speculative import StepCostModel


@dataclass(frozen=True)
class ServiceClass:
    """A class of service: its targets (None: none), the scheduling priority of its requests, and the class a
    request of it may be moved to when it cannot meet them and its client allows it (``demote_to``)."""

    name: str
    ttft_s: float | None = None
    tpot_s: float | None = None
    priority: int = 0
    demote_to: str | None = None

    @classmethod
    def parse(cls, spec: str) -> ServiceClass:
        """``NAME:ttft=MS,tpot=MS,priority=P,demote=OTHER`` (every key optional; times in milliseconds)."""
        name, _, rest = spec.partition(":")
        if not name.strip():
            raise ValueError(f"service class {spec!r}: give it a name, e.g. interactive:ttft=500,tpot=100")
        values: dict = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key not in ("ttft", "tpot", "priority", "demote"):
                raise ValueError(f"service class {spec!r}: {item!r} is not one of ttft=MS, tpot=MS, priority=P, "
                                 "demote=CLASS")
            try:
                if key == "demote":
                    values["demote_to"] = value
                elif key == "priority":
                    values["priority"] = int(value)
                else:
                    ms = float(value)
                    if not ms > 0 or not math.isfinite(ms):
                        raise ValueError
                    values[f"{key}_s"] = ms / 1000.0
            except ValueError:
                raise ValueError(f"service class {spec!r}: {key} must be a positive number, got {value!r}") from None
        return cls(name.strip(), **values)

    @property
    def has_targets(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def meets(self, ttft_s: float, tpot_s: float | None) -> bool:
        """Whether a request of this class that saw ``ttft_s`` and ``tpot_s`` (None: one token) met its targets."""
        return (self.ttft_s is None or ttft_s <= self.ttft_s) and (
            self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s)


class StepTime(Protocol):
    """Seconds one engine step takes that computes ``num_tokens`` tokens of ``num_reqs`` requests, ``has_chunk``
    when one row is a prompt chunk (another path through the model); None while it cannot tell yet."""

    def seconds(self, num_tokens: int, num_reqs: int, has_chunk: bool) -> float | None: ...


class OnlineStepTime:
    """``StepTime`` from the engine's measured steps: ``StepCostModel``'s least-squares line (fixed + per token +
    a prompt chunk's fixed cost) over the last steps, refitted as they come (``observe``)."""

    def __init__(self, window: int = 256) -> None:
        self.model = StepCostModel(window)

    def observe(self, num_tokens: int, seconds: float, has_chunk: bool) -> None:
        self.model.observe(num_tokens, seconds, has_chunk)

    def seconds(self, num_tokens: int, num_reqs: int, has_chunk: bool) -> float | None:
        fitted = self.model.fit()
        if fitted is None:
            return None
        fixed, per_token, chunk = fitted
        return fixed + per_token * num_tokens + (chunk if has_chunk else 0.0)


@dataclass
class InFlight:
    """A request already admitted, as admission counts it: its priority and arrival (its place), the prompt
    tokens still to compute (all of them until its first token), and the output tokens it may still write."""

    priority: int
    arrival: float
    prompt_left: int
    tokens_left: int

    @property
    def decoding(self) -> bool:
        return self.prompt_left == 0 and self.tokens_left > 0


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    tpot_s: float | None  # None: a request of one output token has no TPOT


@dataclass(frozen=True)
class EngineShape:
    """The scheduler's limits the prediction follows: the step's token budget and the running batch's seats."""

    max_num_batched_tokens: int
    max_num_seqs: int


def predict(load: Sequence[InFlight], priority: int, arrival: float, prompt_tokens: int, max_tokens: int,
            shape: EngineShape, step: StepTime, elapsed_s: float = 0.0) -> Prediction | None:
    """The TTFT and TPOT a request would see (see the module's doc); ``elapsed_s``: how long it already waited
    (added to its TTFT: a waiting request is judged by its whole TTFT). None while ``step`` cannot tell."""
    budget = shape.max_num_batched_tokens
    ahead = [r for r in load if r.priority < priority or (r.priority == priority and r.arrival <= arrival)]
    decodes = sum(1 for r in load if r.decoding)
    pending = sum(r.prompt_left for r in load)
    work = sum(r.prompt_left for r in ahead) + prompt_tokens
    per_step = max(budget - decodes, 1)
    full = step.seconds(budget, decodes + 1, True)
    running_now = step.seconds(min(budget, decodes + pending), decodes + 1, pending > 0) if decodes or pending else 0.0
    steps = -(-work // per_step)
    last = step.seconds(decodes + work - (steps - 1) * per_step, decodes + 1, True)
    if full is None or last is None or running_now is None:
        return None
    ttft = elapsed_s + running_now / 2 + (steps - 1) * full + last
    seats_taken = sum(1 for r in ahead if r.prompt_left or r.decoding)
    if seats_taken >= shape.max_num_seqs:  # no seat until the nearest of them finishes
        nearest = min((r.tokens_left for r in ahead if r.decoding), default=0)
        ttft += nearest * full
    if max_tokens <= 1:
        return Prediction(ttft, None)
    later = max_tokens - 1
    rest = pending + prompt_tokens - work  # prompts still to compute once it decodes
    chunked = min(later, -(-rest // max(budget - decodes - 1, 1))) if rest > 0 else 0
    decode_only = step.seconds(decodes + 1, decodes + 1, False)
    if decode_only is None:
        return None
    return Prediction(ttft, (chunked * full + (later - chunked) * decode_only) / later)


def retry_after_s(prediction: Prediction, service: ServiceClass) -> int:
    """Whole seconds after which the same request may fit: how far its TTFT is over the target (at least 1)."""
    over = prediction.ttft_s - service.ttft_s if service.ttft_s is not None else 0.0
    return max(1, math.ceil(over))
