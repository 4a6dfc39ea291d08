"""What ``conveyor bench mixed`` runs and reports (its command line: ``mixed_cli.py``): an interactive stream beside a batch job, over HTTP against a server or on the
simulator, reported as interactive latency, goodput and the engine's total output tokens/s.

Modes (the same traffic in each):

==============  ===================================================================================================
``alone``       the interactive stream alone (the reference for its latency)
``offline``     the batch's requests alone, all at once (the reference for throughput)
``batch-api``   both: the batch as one job of the Batch API (``/v1/files``, ``/v1/batches``; at the lowest
                priority in conveyor)
``fcfs``        both: the batch's requests sent as ordinary requests by ``--batch-concurrency`` clients
``low-priority`` both: as ``fcfs``, each batch request with ``priority`` ``--low-priority`` (vLLM's
                ``--scheduling-policy priority`` serves it)
==============  ===================================================================================================

The measurement window is the interactive stream's (its first send to its last answer); the total output tokens
in it are the engine's (the server's generation-token counter, or the simulated tokens), so the batch's tokens
count whether its requests finish in the window or not. Refused interactive requests (SLO-aware admission: a 429)
count as not meeting the SLO; the time each took to be refused is reported.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field

from conveyor.bench.metrics import LatencyStats, RequestTiming, summarize
from conveyor.bench.workload import Workload
from conveyor.bench.workload_gen import uniform

MODES = ("alone", "offline", "batch-api", "fcfs", "low-priority")
WITH_BATCH = ("offline", "batch-api", "fcfs", "low-priority")
WITH_INTERACTIVE = ("alone", "batch-api", "fcfs", "low-priority")
VLLM_LOW_PRIORITY = 1_000_000  # any int is a vLLM priority; this one is below every interactive request's 0


@dataclass
class MixedTraffic:
    """The interactive stream (Poisson arrivals) and the batch (its requests, arrival times ignored)."""

    interactive: Workload
    batch: Workload
    slo_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class MixedResult:
    mode: str
    window_s: float
    interactive: dict  # metrics.BenchSummary of the interactive requests over the window
    output_tokens: int  # every output token the engine made in the window (interactive and batch)
    refused: int = 0
    refusal_latency: dict = field(default_factory=dict)  # LatencyStats of the refusals (s)
    batch_done: int = 0  # batch requests finished in the window (offline: in all)
    prediction: dict = field(default_factory=dict)  # TTFT / TPOT prediction error (SLO-aware admission), when known
    refused_waiting: int = 0  # refused after admission, while waiting (an in-stream error: its stream had started)
    server_refusal: dict = field(default_factory=dict)  # the server's own time to refuse, when it reports it
    ttfts: list = field(default_factory=list)  # per interactive request, in sending order: [sent at s, TTFT s | None]

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.window_s if self.window_s > 0 else 0.0


def make_traffic(ns: argparse.Namespace) -> MixedTraffic:
    interactive = uniform(ns.interactive_requests, ns.seed, _range(ns.prompt_len), _range(ns.output_len), "poisson",
                          ns.request_rate, vocab_size=ns.vocab_size)
    batch = uniform(ns.batch_requests, ns.seed + 1, _range(ns.batch_prompt_len), _range(ns.batch_output_len),
                    "all-at-once", None, vocab_size=ns.vocab_size)
    slo = {k: v for k in ("ttft", "tpot") if (v := getattr(ns, f"slo_{k}_ms")) is not None}
    return MixedTraffic(interactive, batch, slo)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def result_of(mode: str, timings: list[RequestTiming], window_s: float, output_tokens: int, slo_ms: dict,
              refusal_s: list[float], batch_done: int, prediction: dict | None = None,
              refused_waiting: int = 0, server_refusal: dict | None = None) -> MixedResult:
    summary = summarize(timings, window_s, slo_ms or None).to_dict()
    if slo_ms:  # goodput counts every interactive request that was sent: a refused one did not meet it
        summary["goodput"] = summary["goodput"] or 0.0
    # sorted by the time sent alone: two sent in the same millisecond, one refused (no TTFT), do not compare
    ttfts = sorted(([round(t.arrival, 3), None if t.first_token is None else round(t.first_token - t.arrival, 3)]
                    for t in timings), key=lambda sent_ttft: sent_ttft[0])
    return MixedResult(mode, window_s, summary, output_tokens, len(refusal_s), asdict(LatencyStats.of(refusal_s)),
                       batch_done, prediction or {}, refused_waiting, server_refusal or {}, ttfts)


def format_rows(results: list[MixedResult]) -> str:
    """One markdown row per mode."""
    lines = ["| mode | TTFT p50 / p99 ms | TPOT p50 / p99 ms | goodput req/s | refused (p50 / p99 ms) | output tok/s | "
             "batch done |", "|---|---|---|---|---|---|---|"]
    for r in results:
        s = r.interactive

        def ms(key: str) -> str:
            return "-" if not s[key]["count"] else f"{1e3 * s[key]['p50']:.0f} / {1e3 * s[key]['p99']:.0f}"

        goodput = "-" if s.get("goodput") is None else f"{s['goodput']:.2f}"
        lat = r.refusal_latency
        refused = f"{r.refused} ({1e3 * lat['p50']:.1f} / {1e3 * lat['p99']:.1f})" if r.refused else "0"
        refused += f" + {r.refused_waiting} waiting" if r.refused_waiting else ""
        lines.append(f"| {r.mode} | {ms('ttft')} | {ms('tpot')} | {goodput} | {refused} | {r.output_throughput:.0f} "
                     f"| {r.batch_done} |")
    return "\n".join(lines)
