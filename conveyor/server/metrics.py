"""Prometheus metrics named like vLLM's (``vllm:`` becomes ``conveyor:``), in a registry owned by one app.

Where the numbers come from:
- gauges (running / waiting / KV usage) and the engine's own counters (preemptions, prefix-cache queries and
  hits) are read at scrape time from ``ServedEngine.stats``, the immutable snapshot the engine publishes
  after every step and every command (so they are exact even while the engine idles): the event loop never
  reads the live scheduler;
- per-request histograms and token counters come from every ``RequestOutput`` (``ServedEngine.output_listeners``);
- tokens per step, and what the prefix cache saved (tokens not recomputed, their FLOPs, their seconds at the
  step's measured rate), come from ``StepRecord`` (``ServedEngine.step_listeners``). The hit rate is
  ``rate(prefix_cache_hits) / rate(prefix_cache_queries)``, as in vLLM; no per-prefix label (unbounded
  cardinality): the bench report has the hit rate by prefix.
Listeners run on the engine thread (an engine in this process) or on the event loop (an engine in its own
process, whose records and outputs arrive with each step's message); prometheus-client metrics are thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from conveyor.engine.engine_client import ServedEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.step_record import StepRecord

logger = logging.getLogger("conveyor.server")

# vLLM's buckets, with a few finer ones at the bottom: a small model on a CPU answers in milliseconds.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                         1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
P = "conveyor:"


class _EngineCounters:
    """A collector that reports counters the engine already keeps, from its latest stats snapshot."""

    def __init__(self, async_engine: ServedEngine, labels: dict[str, str]) -> None:
        self.async_engine = async_engine
        self.labels = labels

    def collect(self):
        stats = self.async_engine.stats
        values = [
            ("num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions),
            ("prefix_cache_queries", "Prefix cache queries, in tokens.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache hits, in tokens.", stats.prefix_cache_hits),
        ]
        if self.async_engine.info.args.kv_eviction != "none":  # no vLLM name: vLLM has no KV eviction
            values.append(("kv_evicted_blocks", "KV blocks given back to the pool by KV eviction.",
                           stats.kv_evicted_blocks))
        speculating = self.async_engine.info.args.speculative_config is not None
        if speculating:  # vLLM's spec_decode counters, where speculative decoding is on
            values += [
                ("spec_decode_num_drafts", "Proposals verified (speculative decoding).", stats.spec_num_drafts),
                ("spec_decode_num_draft_tokens", "Proposed tokens verified.", stats.spec_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.", stats.spec_num_accepted_tokens),
            ]
        for name, doc, value in values:
            family = CounterMetricFamily(P + name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), value)
            yield family
        if speculating:
            family = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted proposed tokens by their position in the proposal.",
                                         labels=[*self.labels, "position"])
            for position, value in enumerate(stats.spec_accepted_per_pos):
                family.add_metric([*self.labels.values(), str(position)], value)
            yield family


class ServerMetrics:
    """All metrics of one served model. ``attach()`` wires the listeners."""

    def __init__(self, async_engine: ServedEngine, model_name: str) -> None:
        self.async_engine = async_engine
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)
        r = self.registry

        def gauge(name: str, doc: str, fn) -> None:
            Gauge(P + name, doc, names, registry=r).labels(**labels).set_function(fn)

        gauge("num_requests_running", "Requests in the running batch.", lambda: async_engine.stats.num_running)
        gauge("num_requests_waiting", "Requests waiting to be scheduled.", lambda: async_engine.stats.num_waiting)
        gauge("kv_cache_usage_perc", "KV-cache usage (1 = full).", lambda: async_engine.stats.kv_cache_usage)
        r.register(_EngineCounters(async_engine, labels))

        def counter(name: str, doc: str):
            return Counter(P + name, doc, names, registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets):
            return Histogram(P + name, doc, names, buckets=buckets, registry=r).labels(**labels)

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens processed.")
        self.request_success = Counter(P + "request_success", "Finished requests, by finish reason.",
                                       names + ["finished_reason"], registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.", TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token of a request "
                              "(after the first).", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    REQUEST_LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          ITERATION_TOKEN_BUCKETS)
        # vLLM has no names for these; they sit beside its prefix_cache_queries / prefix_cache_hits.
        self.saved_tokens = counter("prefix_cache_saved_tokens", "Prompt tokens taken from the prefix cache at "
                                    "admission instead of computed.")
        self.saved_flops = counter("prefix_cache_saved_flops", "Model FLOPs of the prompt tokens taken from the "
                                   "prefix cache (linear layers + causal attention over the hit).")
        self.saved_seconds = counter("prefix_cache_saved_seconds", "The saved tokens priced at the measured rate "
                                     "(duration / tokens computed) of the step that admitted them.")
        self._hit_flops = async_engine.info.prefix_hit_flops
        self._labels = labels
        self._counted: dict[str, int] = {}  # request id -> generated tokens already counted
        self._handed_over: set[str] = set()  # continued here from another engine's prefill (note_handed_over)
        # Plain totals for the periodic log line (reading prometheus objects back is not their purpose).
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0

    def attach(self) -> None:
        self.async_engine.output_listeners.append(self.on_output)
        self.async_engine.step_listeners.append(self.on_step)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- listeners (engine thread or loop) ---------------------------------------------------------------
    def on_step(self, record: StepRecord) -> None:
        self.iteration_tokens.observe(record.num_tokens)
        saved = record.num_saved_tokens
        if saved:
            per_token, per_key = self._hit_flops
            self.saved_tokens.inc(saved)
            self.saved_flops.inc(per_token * saved + per_key * record.saved_attended_keys())
            self.saved_seconds.inc(record.saved_seconds())

    def note_handed_over(self, request_id: str) -> None:
        """A request this engine continues from another's first token (disaggregated decode): its prompt and
        first token, and its time to first token, were counted where it was prefilled."""
        self._counted[request_id] = 1
        self._handed_over.add(request_id)

    def on_output(self, out: RequestOutput) -> None:
        m = out.metrics
        if out.kv_handoff is not None:  # prefilled here, decoded elsewhere: its TTFT is ours, its end is not
            self._count_tokens(out)
            self._counted.pop(out.request_id, None)
            if m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
            return
        self._count_tokens(out)
        if out.finished:
            self._counted.pop(out.request_id, None)
            self._observe_finished(out)

    def _count_tokens(self, out: RequestOutput) -> None:
        m = out.metrics
        seen = self._counted.get(out.request_id)
        if seen is None and m.first_token_time is not None:
            seen = 0
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.total_prompt_tokens += len(out.prompt_token_ids)
        if seen is not None:
            delta = out.num_generated_tokens - seen
            self.generation_tokens.inc(delta)
            self.total_generation_tokens += delta
            self._counted[out.request_id] = out.num_generated_tokens

    def _observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        reasons = {c.finish_reason for c in out.outputs}
        reason = "abort" if "abort" in reasons else out.outputs[0].finish_reason
        self.request_success.labels(**self._labels, finished_reason=reason).inc()
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.first_token_time is not None and out.request_id not in self._handed_over:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        self._handed_over.discard(out.request_id)
        for c in out.outputs:
            times = c.token_times
            for a, b in zip(times, times[1:]):
                self.itl.observe(b - a)
            if len(times) > 1:
                self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))


async def log_stats_forever(metrics: ServerMetrics, interval_s: float) -> None:
    """Log a vLLM-style status line every ``interval_s`` seconds while there is activity."""
    last = (time.monotonic(), metrics.total_prompt_tokens, metrics.total_generation_tokens)
    last_kv = (0, 0)
    while True:
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        prompt, gen = metrics.total_prompt_tokens, metrics.total_generation_tokens
        stats = metrics.async_engine.stats
        running, waiting = stats.num_running, stats.num_waiting
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        if prompt == last[1] and gen == last[2] and not running and not waiting:
            last = (now, prompt, gen)
            continue  # idle: stay quiet
        dt = max(now - last[0], 1e-9)
        dq = queries - last_kv[0]
        hit_rate = 100.0 * (hits - last_kv[1]) / dq if dq else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            (prompt - last[1]) / dt, (gen - last[2]) / dt, running, waiting, 100.0 * stats.kv_cache_usage,
            hit_rate,
        )
        last, last_kv = (now, prompt, gen), (queries, hits)
