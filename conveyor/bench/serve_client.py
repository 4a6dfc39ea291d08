"""``conveyor bench serve``: replay a workload against any OpenAI-compatible server over streaming
/v1/completions, and report TTFT, TPOT, ITL, E2E, throughput and goodput with vLLM's definitions.

Timing follows vLLM's serving benchmark: a request's clock starts when it is sent (after waiting for a
``--max-concurrency`` slot), every SSE chunk that carries choices is a token arrival, and output tokens are the
server's ``usage.completion_tokens`` (``stream_options.include_usage``), else the number of chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, replace

from conveyor.bench.metrics import RequestTiming, format_summary, summarize
from conveyor.bench.workload import Workload, WorkloadRequest, load_workload
from conveyor.bench.workload_gen import arrival_times


@dataclass
class ServeBenchConfig:
    base_url: str
    model: str | None = None
    request_rate: float | None = None  # None: the trace's own arrival times; inf: all at once
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0


def schedule(workload: Workload, rate: float | None, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start): the trace's, all at once (rate inf), or Poisson / gamma at ``rate``."""
    n = len(workload.requests)
    if rate is None:
        return [r.arrival_s for r in workload.requests]
    if math.isinf(rate):
        return [0.0] * n
    return arrival_times(n, "poisson" if burstiness == 1.0 else "gamma", rate, random.Random(seed), burstiness)


def request_body(req: WorkloadRequest, model: str) -> dict:
    body = {"model": model, "max_tokens": req.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **req.params}
    body["prompt"] = req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt
    return body


async def send_one(client, req: WorkloadRequest, model: str, t0: float) -> RequestTiming:
    """One streaming completion; never raises (a failure is recorded in ``error``)."""
    import httpx

    timing = RequestTiming(str(req.id), req.prompt_len, 0, time.perf_counter() - t0, None, [], None)
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=request_body(req, model)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                timing.error = f"HTTP {resp.status_code}: {body[:300]}"
                timing.finished = time.perf_counter() - t0  # when it was refused
                return timing
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                chunk = json.loads(data)
                if "error" in chunk:
                    code = chunk["error"].get("code")
                    timing.error = f"stream error{f' ({code})' if code else ''}: {chunk['error'].get('message')}"
                    return timing
                if chunk.get("choices"):
                    timing.server_id = timing.server_id or chunk.get("id")
                    chunks += 1
                    timing.token_times.append(now)
                    if timing.first_token is None:
                        timing.first_token = now
                if chunk.get("usage"):
                    timing.output_tokens = chunk["usage"].get("completion_tokens") or 0
                    timing.prompt_tokens = chunk["usage"].get("prompt_tokens") or timing.prompt_tokens
        timing.output_tokens = timing.output_tokens or chunks
        timing.finished = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


async def run_bench(workload: Workload, cfg: ServeBenchConfig,
                    clock: dict | None = None) -> tuple[list[RequestTiming], float]:
    """Send every request at its time; return the timings and the run's duration (s). Times are seconds since
    the start; ``clock["t0"]``, when given, receives the start on ``time.perf_counter()`` (CLOCK_MONOTONIC on
    Linux, the clock the server's timestamps use), so a run can be joined with the server's own records."""
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s)) as client:
        model = cfg.model or await first_model(client)
        times = schedule(workload, cfg.request_rate, cfg.burstiness, cfg.seed)
        gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        t0 = time.perf_counter()
        if clock is not None:
            clock["t0"] = t0

        async def at_time(req: WorkloadRequest, when: float) -> RequestTiming:
            await asyncio.sleep(max(0.0, when - (time.perf_counter() - t0)))
            if gate is None:
                return await send_one(client, req, model, t0)
            async with gate:
                return await send_one(client, req, model, t0)

        timings = await asyncio.gather(*(at_time(r, t) for r, t in zip(workload.requests, times)))
    return list(timings), time.perf_counter() - t0


async def first_model(client) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def token_prompt_hint(workload: Workload, timings: list[RequestTiming]) -> str | None:
    """When a server refuses token-id prompts, say so plainly (not every server accepts them)."""
    if not any(r.prompt_token_ids is not None for r in workload.requests):
        return None
    refused = [t for t in timings if t.error and t.error.startswith(("HTTP 400", "HTTP 422"))]
    if not refused:
        return None
    return (f"{len(refused)} request(s) were refused with 400/422 ({refused[0].error[:160]}...). This workload "
            "sends prompts as token ids, which not every OpenAI-compatible server accepts (and ids must fit the "
            "served model's vocabulary). Use a workload with text prompts (\"prompt\": \"...\") for such a server.")


def add_serve_client_parser(sub) -> None:
    p = sub.add_parser("serve", help="replay a workload against an OpenAI-compatible server (streaming HTTP)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--workload", default="longtail_v1", help="a packaged trace's name (longtail_v1) or a "
                   "trace file")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="req/s for Poisson/gamma arrivals; 'inf': all at once (default: the trace's arrival times)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, < 1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    for key in ("ttft", "tpot", "e2e"):
        p.add_argument(f"--slo-{key}-ms", type=float, default=None, help=f"goodput SLO on {key.upper()} (ms)")
    p.add_argument("--compare-url", default=None,
                   help="a second OpenAI-compatible server: the same trace is replayed against it after the first "
                   "(same arrivals, same client), and one row per server is printed")
    p.add_argument("--compare-model", default=None, help="model name for --compare-url (default: its first model)")
    p.add_argument("--names", default=None, help="row names for the two servers, comma-separated "
                   "(default: their URLs)")
    p.add_argument("--warmup", type=int, default=0,
                   help="before measuring a server, send it this many of the trace's requests at once, unmeasured")
    p.add_argument("--json", default=None, help="write the summary and per-request timings to this file")
    p.set_defaults(func=run_serve_client)


def run_serve_client(ns: argparse.Namespace) -> int:
    workload = load_workload(ns.workload)
    if ns.num_requests is not None:
        workload = Workload(workload.name, workload.requests[: ns.num_requests], workload.seed,
                            workload.arrival_rate_req_s, workload.notes)
    slo = {k: v for k in ("ttft", "tpot", "e2e") if (v := getattr(ns, f"slo_{k}_ms")) is not None} or None
    targets = [(ns.base_url, ns.model)] + ([(ns.compare_url, ns.compare_model)] if ns.compare_url else [])
    names = ns.names.split(",") if ns.names else [url for url, _ in targets]
    if len(names) != len(targets):
        raise SystemExit(f"--names needs {len(targets)} names, got {len(names)}")
    arrivals = "trace arrivals" if ns.request_rate is None else f"{ns.request_rate:g} req/s"
    runs, failed = [], False
    for name, (url, model) in zip(names, targets):
        cfg = ServeBenchConfig(url, model, ns.request_rate, ns.burstiness, ns.max_concurrency, ns.seed,
                               ns.api_key, ns.timeout)
        if ns.warmup:
            warm = Workload(workload.name, workload.requests[: ns.warmup], workload.seed)
            asyncio.run(run_bench(warm, replace(cfg, request_rate=math.inf)))
        print(f"[bench serve] {len(workload.requests)} requests of {workload.name} to {url} ({arrivals})",
              file=sys.stderr)
        clock: dict = {}
        timings, duration = asyncio.run(run_bench(workload, cfg, clock))
        summary = summarize(timings, duration, slo)
        print(format_summary(summary, f"bench serve: {workload.name} -> {name}"))
        if hint := token_prompt_hint(workload, timings):
            print(f"[bench serve] {hint}", file=sys.stderr)
        elif summary.num_failed:
            first = next(t.error for t in timings if t.error)
            print(f"[bench serve] {summary.num_failed} request(s) failed; first error: {first}", file=sys.stderr)
        failed = failed or summary.num_failed > 0
        config = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
        runs.append({"name": name, "config": config, "workload": workload.name, "clock_t0": clock.get("t0"),
                     "summary": summary.to_dict(), "requests": [asdict(t) for t in timings]})
    if len(runs) > 1:
        print(format_rows([(r["name"], r["summary"]) for r in runs]))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(runs[0] if len(runs) == 1 else {"runs": runs}, f, indent=1)
    return 1 if failed else 0


def format_rows(rows: list[tuple[str, dict]]) -> str:
    """One markdown row per server: TTFT, TPOT, ITL (ms) and E2E (s) p50 / p99, output tok/s, goodput."""
    lines = ["| server | TTFT p50 / p99 | TPOT p50 / p99 | ITL p50 / p99 | E2E p50 / p99 | output tok/s | goodput |",
             "|---|---|---|---|---|---|---|"]
    for name, s in rows:
        def ms(key: str) -> str:
            return f"{1e3 * s[key]['p50']:.0f} / {1e3 * s[key]['p99']:.0f} ms"

        goodput = "-" if s.get("goodput") is None else f"{s['goodput']:.2f} req/s"
        lines.append(f"| {name} | {ms('ttft')} | {ms('tpot')} | {ms('itl')} | {s['e2e']['p50']:.2f} / "
                     f"{s['e2e']['p99']:.2f} s | {s['output_throughput']:.0f} | {goodput} |")
    return "\n".join(lines)
