"""Latency and throughput metrics with the field's definitions (vLLM's serving benchmark). PURE PYTHON.

Shared by the in-process online benchmark and the HTTP benchmark client, so their reports agree line by line. Every time is in seconds on one clock (whichever the caller used); only differences matter.

- TTFT: ``first_token - arrival``.
- TPOT (per request, only when it produced more than one token): ``(last token time - first_token) /
  (output_tokens - 1)``. The last token time is ``token_times[-1]``, or ``finished`` when no token times exist.
- ITL: every gap between consecutive ``token_times``, pooled over all requests (a server that sends several
  tokens in one chunk yields fewer, longer gaps, as in vLLM).
- E2E: ``finished - arrival``. Queue: ``first_scheduled - arrival`` (only when known).
- Throughputs count completed requests only, over ``duration_s``.
- Goodput: completed requests that meet every given SLO (``slo_ms`` keys "ttft", "tpot", "e2e", milliseconds),
  per second of ``duration_s``. A request with one output token has no TPOT and passes a TPOT SLO.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass
class RequestTiming:
    """One request as a client or the engine observed it; all times in seconds on one clock."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    arrival: float
    first_token: float | None
    token_times: list[float]  # when each output token arrived (the first included); may be fewer than
    # output_tokens when a server batches tokens into one chunk
    finished: float | None
    first_scheduled: float | None = None
    error: str | None = None  # set when the request failed
    server_id: str | None = None  # the id the server gave the response (HTTP client only), to join its logs

    @property
    def completed(self) -> bool:
        return self.error is None and self.finished is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.output_tokens <= 1:
            return None
        last = self.token_times[-1] if self.token_times else self.finished
        if last is None:
            return None
        return (last - self.first_token) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def queue(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class LatencyStats:
    """Summary of one latency distribution, in seconds. All zeros when there are no samples."""

    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    count: int = 0  # samples; 0 means "not observed" (e.g. queue time seen from an HTTP client)

    @classmethod
    def of(cls, values: list[float]) -> LatencyStats:
        if not values:
            return cls()
        return cls(sum(values) / len(values), percentile(values, 50), percentile(values, 90),
                   percentile(values, 99), max(values), len(values))


@dataclass
class BenchSummary:
    """Everything one benchmark run reports (throughputs per second of ``duration_s``)."""

    num_requests: int
    num_completed: int
    num_failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float  # output tokens / s
    total_throughput: float  # (prompt + output) tokens / s
    ttft: LatencyStats = field(default_factory=LatencyStats)
    tpot: LatencyStats = field(default_factory=LatencyStats)
    itl: LatencyStats = field(default_factory=LatencyStats)
    e2e: LatencyStats = field(default_factory=LatencyStats)
    queue: LatencyStats = field(default_factory=LatencyStats)
    goodput: float | None = None  # req/s meeting every SLO; None when no SLO was given
    slo_ms: dict[str, float] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks, like numpy's default."""
    if not values:
        return 0.0
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _meets_slos(t: RequestTiming, slo_ms: dict[str, float]) -> bool:
    for key, limit_ms in slo_ms.items():
        value = getattr(t, key)
        if value is None:
            if key == "tpot":
                continue  # one output token: no time per output token to violate
            return False
        if value * 1000.0 > limit_ms:
            return False
    return True


def summarize(timings: list[RequestTiming], duration_s: float, slo_ms: dict[str, float] | None = None
              ) -> BenchSummary:
    """Aggregate per-request timings of one run that lasted ``duration_s`` seconds."""
    if slo_ms:
        unknown = set(slo_ms) - set(SLO_KEYS)
        if unknown:
            raise ValueError(f"unknown SLO keys {sorted(unknown)}; use {', '.join(SLO_KEYS)}")
    done = [t for t in timings if t.completed]
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    output_tokens = sum(t.output_tokens for t in done)
    total_tokens = output_tokens + sum(t.prompt_tokens for t in done)

    def stats(name: str) -> LatencyStats:
        return LatencyStats.of([v for t in done if (v := getattr(t, name)) is not None])

    goodput = None
    if slo_ms:
        goodput = per_s(sum(1 for t in done if _meets_slos(t, slo_ms)))
    return BenchSummary(
        num_requests=len(timings),
        num_completed=len(done),
        num_failed=sum(1 for t in timings if t.error is not None),
        duration_s=duration_s,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(output_tokens),
        total_throughput=per_s(total_tokens),
        ttft=stats("ttft"),
        tpot=stats("tpot"),
        itl=LatencyStats.of([gap for t in done for gap in t.itls()]),
        e2e=stats("e2e"),
        queue=stats("queue"),
        goodput=goodput,
        slo_ms=dict(slo_ms) if slo_ms else None,
    )


def format_summary(summary: BenchSummary, title: str = "") -> str:
    """A fixed-width text block like vLLM's ``bench serve`` result (latencies in milliseconds)."""
    s = summary
    width = 50
    lines = [f"{(' ' + title + ' ') if title else ' Benchmark result ':=^{width}}"]

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<36}{value:>14}")

    row("Requests completed / total:", f"{s.num_completed} / {s.num_requests}")
    row("Failed requests:", str(s.num_failed))
    row("Duration (s):", f"{s.duration_s:.2f}")
    row("Request throughput (req/s):", f"{s.request_throughput:.2f}")
    row("Output token throughput (tok/s):", f"{s.output_throughput:.1f}")
    row("Total token throughput (tok/s):", f"{s.total_throughput:.1f}")
    if s.goodput is not None:
        slos = ", ".join(f"{k}<={v:g}ms" for k, v in (s.slo_ms or {}).items())
        row(f"Goodput (req/s) [{slos}]:", f"{s.goodput:.2f}")
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                        ("itl", "Inter-token Latency"), ("e2e", "End-to-end Latency"), ("queue", "Queue Time")):
        st: LatencyStats = getattr(s, name)
        if st.count == 0:
            continue  # not observed: print nothing rather than zeros that read like a measurement
        lines.append(f"{label:-^{width}}")
        for stat in ("mean", "p50", "p90", "p99", "max"):
            row(f"{stat.capitalize() if stat == 'mean' else stat.upper()} {name.upper()} (ms):",
                f"{getattr(st, stat) * 1000:.2f}")
    lines.append("=" * width)
    return "\n".join(lines)
