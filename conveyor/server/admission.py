"""SLO-aware admission in the server: each request's service class (from ``service_tier``), its TTFT and TPOT
predicted when it arrives and again while it waits (``core.admission``), a 429 with ``Retry-After`` at once for one
that cannot meet its class's targets (or a lower class, when its client allowed that with ``service_tier: auto``),
and per class the requests admitted, refused, demoted and finished within or past their targets.

The prediction reads what this server has in flight (every request it submitted: its priority, its prompt, whether
its first token came, what it may still write) and the engine's step times, fitted online from the steps it reports
(``ServedEngine.step_listeners``). The listeners run on the engine's thread (an engine in this process) or on the
event loop (an engine in its own process); one lock guards the books.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from conveyor.core.admission import (
    EngineShape, InFlight, OnlineStepTime, Prediction, ServiceClass, StepTime, predict, retry_after_s,
)
from conveyor.core.config import resolve_scheduling_policy
from conveyor.core.policies import BATCH_PRIORITY
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.engine_client import EngineInfo, Prepare, ServedEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.step_record import StepRecord
from conveyor.server.errors import APIError, bad_request

logger = logging.getLogger("conveyor.server")

RECHECK_EVERY_S = 0.05  # how often waiting requests are judged again (at most; on the engine's steps)
ERROR_WINDOW = 2000  # the last finished requests the prediction errors are reported over
# The prediction's TTFT and TPOT are each scaled by the median measured / predicted ratio of the last
# CALIBRATION_WINDOW finished requests (once CALIBRATION_MIN have finished), within CALIBRATION_BOUNDS: what the
# first-order model leaves out (attention over long contexts, prefix hits, the server's own time, the time between
# steps, the prompts that arrive after a request and share its decode steps) is this deployment's, and mostly a
# factor.
CALIBRATION_WINDOW, CALIBRATION_MIN, CALIBRATION_BOUNDS = 200, 20, (0.5, 4.0)


class SLORefusedError(APIError):
    """429: the request cannot meet its class's target now; ``Retry-After`` says when it may."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(429, message, "service_tier", "slo_unattainable", {"Retry-After": str(retry_after)})


def add_admission_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("service classes and SLO-aware admission")
    g.add_argument("--service-class", action="append", default=[], metavar="NAME:ttft=MS,tpot=MS,priority=P,demote=C",
                   help="a class of service with its targets (TTFT, mean time per output token, in ms), the "
                   "scheduling priority of its requests and the class a request may be moved to when it cannot meet "
                   "them; requests pick one with service_tier. Repeat for several. A request that cannot meet its "
                   "class's targets is refused at once (429, Retry-After)")
    g.add_argument("--default-service-class", default=None, metavar="NAME",
                   help="the class of requests that name none (default: the first --service-class)")


@dataclass(frozen=True)
class Admitted:
    service: ServiceClass
    priority: int
    prediction: Prediction | None


class ServiceClasses:
    """The configured classes by name, and which one a request's ``service_tier`` picks."""

    def __init__(self, classes: list[ServiceClass], default: str | None = None) -> None:
        if not classes:
            raise ValueError("service classes: give at least one")
        self.by_name = {c.name: c for c in classes}
        if len(self.by_name) != len(classes):
            raise ValueError("service classes: two share a name")
        self.default = self.by_name.get(default or classes[0].name)
        if self.default is None:
            raise ValueError(f"--default-service-class {default!r} is not one of {', '.join(self.by_name)}")
        for c in classes:
            if c.demote_to is not None and c.demote_to not in self.by_name:
                raise ValueError(f"service class {c.name}: demote={c.demote_to} is not a class")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServiceClasses | None:
        if not ns.service_class:
            return None
        return cls([ServiceClass.parse(s) for s in ns.service_class], ns.default_service_class)

    def resolve(self, tier: str | None) -> tuple[ServiceClass, bool]:
        """(the class, whether it may be demoted): None and OpenAI's "default" pick the default class; "auto"
        picks it too and lets it be moved to a lower class rather than refused; a class's name picks that class."""
        if tier is None or tier == "default":
            return self.default, False
        if tier == "auto":
            return self.default, True
        found = self.by_name.get(tier)
        if found is None:
            raise bad_request(f"service_tier must be auto, default or one of this server's service classes "
                              f"({', '.join(self.by_name)}), got {tier[:40]!r}", "service_tier")
        return found, False


@dataclass
class _Tracked:
    load: InFlight
    service: ServiceClass
    max_tokens: int
    predicted_ttft: tuple[float, float] | None  # (the model's, calibrated) at admission
    predicted_tpot: tuple[float, float] | None = None  # (the model's, calibrated); None: one token, no TPOT


class AdmissionController:
    """Admits or refuses requests by their predicted TTFT and TPOT, and keeps the books the prediction reads."""

    def __init__(self, classes: ServiceClasses, shape: EngineShape, registry: CollectorRegistry,
                 step: StepTime | None = None) -> None:
        self.classes, self.shape = classes, shape
        self.step = step or OnlineStepTime()
        self._lock = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}
        self._errors: deque[tuple[float, float]] = deque(maxlen=ERROR_WINDOW)  # (predicted, measured) TTFT
        self._tpot_errors: deque[tuple[float, float]] = deque(maxlen=ERROR_WINDOW)  # (predicted, measured) TPOT
        self._raw: deque[tuple[float, float]] = deque(maxlen=CALIBRATION_WINDOW)  # (the model's, measured) TTFT
        self._raw_tpot: deque[tuple[float, float]] = deque(maxlen=CALIBRATION_WINDOW)  # (the model's, measured)
        self._last_recheck = 0.0
        self._engine: ServedEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's, where a refusal is delivered
        self.decisions = Counter("conveyor:slo_requests", "Requests by service class and admission decision "
                                 "(admitted, refused, demoted: admitted to the lower class it names).",
                                 ["service_class", "decision"], registry=registry)
        self.outcomes = Counter("conveyor:slo_finished_requests", "Finished requests of classes with targets, by "
                                "whether they met them.", ["service_class", "slo"], registry=registry)
        self.decision_time = Histogram("conveyor:slo_admission_decision_seconds", "Time from a request's admission "
                                       "check starting (before its prompt is tokenized) to its decision, by decision "
                                       "(admitted, refused).", ["decision"], registry=registry,
                                       buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0))
        registry.register(_PredictionError(self))

    def attach(self, engine: ServedEngine) -> None:
        self._engine = engine
        engine.step_listeners.append(self.on_step)
        engine.output_listeners.append(self.on_output)

    # ---- decisions (the event loop) ---------------------------------------------------------------------
    def admit(self, request_id: str, prompt_lengths: list[int], max_tokens: int, priority: int,
              tier: str | None) -> Admitted:
        """The class and priority a request runs at, and its prediction; raises SLORefusedError (429) when it
        cannot meet its class's targets and may not be demoted, or no lower class fits either. ``priority``: the
        request's own (0: none asked; it then runs at its class's)."""
        self._loop = asyncio.get_running_loop()
        service, may_demote = self.classes.resolve(tier)
        if priority == BATCH_PRIORITY:  # the Batch API's lines: no targets, and they never wait for anyone
            return Admitted(service, priority, None)
        now = time.monotonic()
        prompt = sum(prompt_lengths)
        while True:
            runs_at = priority or service.priority
            with self._lock:
                load = [t.load for t in self._tracked.values()]
            raw = predict(load, runs_at, now, prompt, max_tokens, self.shape, self.step)
            prediction = self._calibrated(raw)
            if prediction is None or not service.has_targets or service.meets(prediction.ttft_s, prediction.tpot_s):
                break
            lower = self.classes.by_name.get(service.demote_to) if may_demote and service.demote_to else None
            if lower is None:
                self.decisions.labels(service.name, "refused").inc()
                raise SLORefusedError(_refusal(service, prediction), retry_after_s(prediction, service))
            self.decisions.labels(service.name, "demoted").inc()
            service = lower
        with self._lock:
            for i, length in enumerate(prompt_lengths):
                self._tracked[f"{request_id}-{i}"] = _Tracked(
                    InFlight(runs_at, now, length, max_tokens), service, max_tokens,
                    (raw.ttft_s, prediction.ttft_s) if prediction else None,
                    (raw.tpot_s, prediction.tpot_s) if prediction and prediction.tpot_s is not None else None)
        self.decisions.labels(service.name, "admitted").inc()
        return Admitted(service, runs_at, prediction)

    async def admit_prompts(self, request_id: str, prompts: list, each: list[SamplingParams], tier: str | None,
                            tokenizer_call: Callable, max_model_len: int) -> tuple[list[Prepare], list[SamplingParams]]:
        """``admit`` a request about to be submitted: its prompts made and tokenized first (off the event loop,
        by ``tokenizer_call``, as its add would), so that the decision knows their lengths and needs no engine
        round trip; the prompts as made, and the params at the priority it runs at. Raises SLORefusedError."""
        start = time.monotonic()
        prepared = await tokenizer_call(lambda info: [_prepared(p, info) for p in prompts])
        lengths = [len(p["prompt_token_ids"]) for p in prepared]
        first = each[0]
        max_tokens = first.max_tokens or max(max_model_len - max(lengths), 1)
        try:
            admitted = self.admit(request_id, lengths, max_tokens, first.priority, tier)
        except SLORefusedError:
            self.decision_time.labels("refused").observe(time.monotonic() - start)
            raise
        self.decision_time.labels("admitted").observe(time.monotonic() - start)
        if admitted.priority != first.priority:
            each = [dataclasses.replace(p, priority=admitted.priority) for p in each]
        return [lambda _, p=p: p for p in prepared], each

    def release(self, request_id: str, num_prompts: int) -> None:
        """Forget a request whose submission failed after ``admit``."""
        with self._lock:
            for i in range(num_prompts):
                self._tracked.pop(f"{request_id}-{i}", None)

    # ---- listeners (the engine's thread or the event loop) ----------------------------------------------
    def on_step(self, record: StepRecord) -> None:
        self.step.observe(record.num_tokens, record.duration, record.num_prefill_tokens > 0)
        now = time.monotonic()
        if now - self._last_recheck >= RECHECK_EVERY_S:
            self._last_recheck = now
            self._recheck_waiting(now)

    def on_output(self, out: RequestOutput) -> None:
        with self._lock:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                return
            generated = max((len(c.token_ids) for c in out.outputs), default=0)
            if generated:
                tracked.load.prompt_left = 0
                tracked.load.tokens_left = max(tracked.max_tokens - generated, 0)
            if not out.finished:
                return
            del self._tracked[out.request_id]
        ttft = out.metrics.ttft
        if ttft is None or any(c.finish_reason == "abort" for c in out.outputs):
            return
        times = out.outputs[0].token_times
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        if tracked.predicted_ttft is not None:
            raw, calibrated = tracked.predicted_ttft
            with self._lock:
                self._errors.append((calibrated, ttft))
                self._raw.append((raw, ttft))
                if tracked.predicted_tpot is not None and tpot is not None:
                    raw_tpot, calibrated_tpot = tracked.predicted_tpot
                    self._tpot_errors.append((calibrated_tpot, tpot))
                    self._raw_tpot.append((raw_tpot, tpot))
        if tracked.service.has_targets:
            self.outcomes.labels(tracked.service.name, "met" if tracked.service.meets(ttft, tpot) else "missed").inc()

    def _recheck_waiting(self, now: float) -> None:
        engine, loop = self._engine, self._loop
        if engine is None or loop is None:
            return
        for request_id, error in self.overdue(now):
            loop.call_soon_threadsafe(engine.fail_request, request_id, error)

    def overdue(self, now: float) -> list[tuple[str, SLORefusedError]]:
        """The waiting requests (no first token yet) that can no longer meet their TTFT target, judged with what
        they have waited by ``now``: forgotten here, each with the error its client gets."""
        with self._lock:
            items = list(self._tracked.items())
        load = [t.load for _, t in items]
        refused = []
        for request_id, t in items:
            target = t.service.ttft_s
            if target is None or not t.load.prompt_left:
                continue
            others = [x for x in load if x is not t.load]
            waited = now - t.load.arrival
            prediction = self._calibrated(predict(others, t.load.priority, t.load.arrival, t.load.prompt_left,
                                                  t.load.tokens_left, self.shape, self.step), waited)
            if prediction is None or prediction.ttft_s <= target:
                continue
            with self._lock:
                if self._tracked.pop(request_id, None) is None:
                    continue  # its first token came meanwhile
            self.decisions.labels(t.service.name, "refused").inc()
            refused.append((request_id, SLORefusedError(_refusal(t.service, prediction, waited=now - t.load.arrival),
                                                        retry_after_s(prediction, t.service))))
        return refused

    def _calibrated(self, p: Prediction | None, waited: float = 0.0) -> Prediction | None:
        """``p`` (a TTFT from now) with its TTFT and TPOT each scaled by the measured / predicted ratio this
        server has seen, plus what the request already ``waited``."""
        if p is None:
            return None
        with self._lock:
            ttft_scale, tpot_scale = _scale(self._raw), _scale(self._raw_tpot)
        return Prediction(waited + p.ttft_s * ttft_scale, None if p.tpot_s is None else p.tpot_s * tpot_scale)

    def prediction_errors(self) -> list[tuple[float, float]]:
        """(predicted, measured) TTFT of the last finished requests that were predicted."""
        with self._lock:
            return list(self._errors)

    def tpot_prediction_errors(self) -> list[tuple[float, float]]:
        """(predicted, measured) TPOT of the last finished requests that were predicted and wrote two tokens."""
        with self._lock:
            return list(self._tpot_errors)


def _scale(pairs: deque[tuple[float, float]]) -> float:
    """The median measured / predicted ratio of ``pairs`` within CALIBRATION_BOUNDS; 1 until CALIBRATION_MIN."""
    ratios = sorted(m / q for q, m in pairs if q > 0)
    if len(ratios) < CALIBRATION_MIN:
        return 1.0
    low, high = CALIBRATION_BOUNDS
    return min(max(ratios[len(ratios) // 2], low), high)


def _prepared(prompt, info: EngineInfo) -> dict:
    """A prompt made and tokenized: ``{"prompt": text or None, "prompt_token_ids": [...]}``."""
    text, ids = info.tokenize_prompt(prompt(info) if callable(prompt) else prompt)
    return {"prompt": text, "prompt_token_ids": ids}


def make_admission(classes: ServiceClasses, engine: ServedEngine, registry: CollectorRegistry) -> AdmissionController:
    """The controller for ``engine``'s requests, its metrics in ``registry``, listening to the engine. A class's
    priority needs an engine that serves by priority."""
    args = engine.info.args
    if resolve_scheduling_policy(args.policy, args.scheduling_policy) != "priority" and any(
            c.priority for c in classes.by_name.values()):
        raise ValueError("service classes with a priority need --scheduling-policy priority")
    controller = AdmissionController(classes, EngineShape(args.max_num_batched_tokens, args.max_num_seqs), registry)
    controller.attach(engine)
    return controller


def _refusal(service: ServiceClass, p: Prediction, waited: float | None = None) -> str:
    targets = ", ".join(f"{name} {value * 1000:.0f} ms" for name, value in (("TTFT", service.ttft_s),
                                                                          ("TPOT", service.tpot_s)) if value)
    seen = f"TTFT {p.ttft_s * 1000:.0f} ms" + (f", TPOT {p.tpot_s * 1000:.0f} ms" if p.tpot_s is not None else "")
    when = f" after waiting {waited * 1000:.0f} ms" if waited is not None else ""
    return (f"service class {service.name} cannot meet its targets now ({targets}): predicted {seen}{when}; "
            "retry later")


class _PredictionError:
    """Quantiles of the TTFT and TPOT predictions' errors over the last finished requests: the absolute error in
    seconds and the measured / predicted ratio."""

    def __init__(self, controller: AdmissionController) -> None:
        self.controller = controller

    def collect(self):
        for what, pairs in (("ttft", self.controller.prediction_errors()),
                            ("tpot", self.controller.tpot_prediction_errors())):
            absolute = GaugeMetricFamily(f"conveyor:slo_{what}_prediction_abs_error_seconds",
                                         f"|measured - predicted| {what.upper()} over the last finished requests, "
                                         "by quantile.", labels=["quantile"])
            ratio = GaugeMetricFamily(f"conveyor:slo_{what}_prediction_ratio", f"measured / predicted "
                                      f"{what.upper()} over the last finished requests, by quantile.",
                                      labels=["quantile"])
            if pairs:
                errors = sorted(abs(m - p) for p, m in pairs)
                ratios = sorted(m / p for p, m in pairs if p > 0)
                for q in (0.5, 0.9):
                    absolute.add_metric([str(q)], _quantile(errors, q))
                    if ratios:
                        ratio.add_metric([str(q)], _quantile(ratios, q))
            yield absolute
            yield ratio


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[round(q * (len(ordered) - 1))]
