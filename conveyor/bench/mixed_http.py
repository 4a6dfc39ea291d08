"""``bench mixed`` over HTTP: the interactive stream as streaming completions (``serve_client``), the batch as a
Batch API job (the ``openai`` SDK) or as ordinary completions from ``--batch-concurrency`` clients; the engine's
output tokens from the server's Prometheus counter (conveyor's or vLLM's)."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import time

from prometheus_client.parser import text_string_to_metric_families

from conveyor.bench.mixed import MixedResult, MixedTraffic, result_of
from conveyor.bench.serve_client import ServeBenchConfig, first_model, run_bench
from conveyor.bench.workload import Workload, WorkloadRequest

TOKEN_COUNTERS = ("conveyor:generation_tokens_total", "vllm:generation_tokens_total")
SLO_REFUSED = "slo_unattainable"  # the error code of SLO-aware admission's refusals
BATCH_START_S = 2.0  # how long the batch runs alone before the interactive stream starts (its slots fill)


async def scrape(client) -> dict[str, float]:
    """Every sample of the server's /metrics, by name and labels, summed over the labels' values."""
    text = (await client.get("/metrics")).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items())
                                        if k not in ("model_name", "engine"))
            out[key] = out.get(key, 0.0) + sample.value
    return out


def generation_tokens(samples: dict[str, float]) -> float:
    return sum(samples.get(name, 0.0) for name in TOKEN_COUNTERS)


async def run_http(ns: argparse.Namespace, traffic: MixedTraffic, mode: str) -> MixedResult:
    import httpx

    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=ns.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(ns.timeout)) as client:
        model = ns.model or await first_model(client)
        batch = BatchTraffic(client, ns, traffic.batch, model, mode)
        first = await scrape(client)
        before = generation_tokens(first)
        start = time.perf_counter()
        await batch.start()
        if mode == "offline":
            await batch.wait()
            window = time.perf_counter() - start
            tokens = generation_tokens(await scrape(client)) - before
            return result_of(mode, [], window, int(tokens), {}, [], batch.done)
        if mode != "alone":
            await asyncio.sleep(BATCH_START_S)
            before = generation_tokens(await scrape(client))
        interactive = _with_params(traffic.interactive, ns.service_tier)
        timings, window = await run_bench(interactive, ServeBenchConfig(ns.base_url, model, None, seed=ns.seed,
                                                                        api_key=ns.api_key, timeout_s=ns.timeout))
        samples = await scrape(client)
        tokens = generation_tokens(samples) - before
        await batch.stop()
        done = batch.done
    refusals = [t.finished - t.arrival for t in timings if t.error and t.error.startswith("HTTP 429")
                and t.finished is not None]
    # judged again while waiting and refused: its stream had started, so the refusal came in it
    refused_waiting = sum(1 for t in timings if t.error and t.error.startswith(f"stream error ({SLO_REFUSED})"))
    return result_of(mode, timings, window, int(tokens), traffic.slo_ms, refusals, done, prediction_error(samples),
                     refused_waiting, server_refusal_time(first, samples))


def _with_params(workload: Workload, service_tier: str | None) -> Workload:
    if service_tier is None:
        return workload
    requests = [WorkloadRequest(r.id, r.arrival_s, r.prompt_token_ids, r.prompt, r.max_tokens, r.kind,
                                {**r.params, "service_tier": service_tier}) for r in workload.requests]
    return Workload(workload.name, requests, workload.seed, workload.arrival_rate_req_s, workload.notes)


def prediction_error(samples: dict[str, float]) -> dict:
    """The server's TTFT and TPOT prediction error quantiles (SLO-aware admission), when it reports them:
    ``ttft_abs_error_s_p50``, ``ttft_measured_over_predicted_p90``, ``tpot_...``."""
    out = {}
    for what in ("ttft", "tpot"):
        for name, key in ((f"conveyor:slo_{what}_prediction_abs_error_seconds", "abs_error_s"),
                          (f"conveyor:slo_{what}_prediction_ratio", "measured_over_predicted")):
            for q in ("0.5", "0.9"):
                if (value := samples.get(f"{name}|quantile={q}")) is not None:
                    out[f"{what}_{key}_p{int(float(q) * 100)}"] = value
    return out


def server_refusal_time(before: dict[str, float], after: dict[str, float]) -> dict:
    """The server's own time to refuse (conveyor's ``slo_admission_decision_seconds{decision="refused"}``, from
    the admission check's start to the refusal) over the run: the refusals, how many took at most 50 ms, and
    the histogram bucket holding the p50 and the p99 (an upper bound of each)."""
    name = "conveyor:slo_admission_decision_seconds"
    count = after.get(f"{name}_count|decision=refused", 0.0) - before.get(f"{name}_count|decision=refused", 0.0)
    if count <= 0:
        return {}
    buckets = sorted((float(key.rsplit("le=", 1)[1]), value - before.get(key, 0.0)) for key, value in after.items()
                     if key.startswith(f"{name}_bucket|decision=refused|le="))

    def bound(q: float) -> float:
        return next(le for le, n in buckets if n >= q * count)

    within = dict(buckets)
    return {"server_refused": int(count), "server_refused_within_50ms": int(within.get(0.05, 0.0)),
            "server_refusal_s_p50_at_most": bound(0.5), "server_refusal_s_p99_at_most": bound(0.99)}


class BatchTraffic:
    """The batch, as a Batch API job or as ordinary completions from a number of clients."""

    def __init__(self, client, ns: argparse.Namespace, batch: Workload, model: str, mode: str) -> None:
        self.client, self.ns, self.batch, self.model, self.mode = client, ns, batch, model, mode
        self.tasks: list[asyncio.Task] = []
        self.finished = 0
        self.job_id: str | None = None

    def body(self, r: WorkloadRequest, priority: int | None) -> dict:
        body = {"model": self.model, "prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, **r.params}
        return body if priority is None else {**body, "priority": priority}

    async def start(self) -> None:
        if self.mode == "batch-api":
            await self._create_job()
        elif self.mode in ("fcfs", "low-priority", "offline"):
            priority = self.ns.low_priority if self.mode == "low-priority" else None
            queue = list(self.batch.requests)
            clients = len(queue) if self.mode == "offline" else self.ns.batch_concurrency  # offline: all at once
            for _ in range(min(clients, len(queue))):
                self.tasks.append(asyncio.create_task(self._client(queue, priority)))

    async def _client(self, queue: list[WorkloadRequest], priority: int | None) -> None:
        while queue:
            r = queue.pop(0)
            resp = await self.client.post("/v1/completions", json=self.body(r, priority))
            if resp.status_code == 200:
                self.finished += 1

    async def _create_job(self) -> None:
        lines = [json.dumps({"custom_id": f"b{r.id}", "method": "POST", "url": "/v1/completions",
                             "body": self.body(r, None)}) for r in self.batch.requests]
        files = {"file": ("batch.jsonl", io.BytesIO("\n".join(lines).encode()), "application/jsonl")}
        uploaded = await self.client.post("/v1/files", data={"purpose": "batch"}, files=files)
        uploaded.raise_for_status()
        job = await self.client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                                          "endpoint": "/v1/completions", "completion_window": "24h"})
        job.raise_for_status()
        self.job_id = job.json()["id"]

    @property
    def done(self) -> int:
        return self.finished if self.job_id is None else self._job_done

    async def wait(self) -> None:
        await asyncio.gather(*self.tasks)

    async def stop(self) -> None:
        if self.job_id is not None:
            job = (await self.client.post(f"/v1/batches/{self.job_id}/cancel")).json()
            self._job_done = job["request_counts"]["completed"]
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    _job_done = 0
