#!/usr/bin/env python3
"""Soak test: N requests against ``conveyor serve`` with random client disconnects; checks nothing leaks.

    python scripts/soak.py --streams 2000 --disconnect 0.4            # starts `conveyor serve` (embedded model)
    python scripts/soak.py --streams 200 --json out.json -- --model DIR --max-num-seqs 64   # serve flags after --

It starts the server itself on a free loopback port (so it can read its RSS and log), warms it up, then sends
``--streams`` requests, ``--concurrency`` at a time: /v1/completions 60% / chat 40%, ``n=2`` 10%, temperature 0 or
0.8, ``max_tokens`` 8-64, prompts of 1-400 characters, streams with ``include_usage``. A fraction
``--disconnect`` of the streams is closed by the client after 1-4 chunks; a fraction ``--abandon`` of all requests
is non-streaming and abandoned by a 50 ms client timeout. A warm-up of the same mix (``--warmup`` requests) comes
first, so that RSS growth is measured from the allocators' working size, not from an idle process. It passes
(exit 0) when:

- no request got an HTTP error, a client-side exception or an in-band error chunk;
- every stream read to the end ends with ``data: [DONE]`` and one finish_reason (stop / length) per choice;
- after the run the running / waiting / KV-usage gauges return to 0 (within 10 s), /health is 200 and an
  ordinary request is served;
- the server's RSS grew by less than ``--max-rss-growth-mb`` from after the warm-up to the end;
- the server log holds no traceback and no ERROR line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

GAUGES = ("conveyor:num_requests_running", "conveyor:num_requests_waiting", "conveyor:kv_cache_usage_perc")
WORDS = ["conveyor", "belt", "batch", "token", "cache", "block", "prefill", "decode", "stream", "server", "river",
         "stone", "light", "paper", "window", "garden", "number", "orange", "silver", "market", "engine", "quiet"]


@dataclass
class Tally:
    requests: int = 0
    completed_streams: int = 0
    disconnected_streams: int = 0
    abandoned_non_streaming: int = 0
    completed_non_streaming: int = 0
    http_errors: dict[str, int] = field(default_factory=dict)
    client_exceptions: dict[str, int] = field(default_factory=dict)
    in_band_errors: int = 0
    missing_done: int = 0
    bad_finish: int = 0
    completion_tokens: int = 0

    def count(self, bucket: dict[str, int], key: str) -> None:
        bucket[key] = bucket.get(key, 0) + 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in GAUGES:
                values[sample.name] = sample.value
    return values


def request_body(rng: random.Random, model: str) -> tuple[str, dict]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))[: rng.randint(1, 400)] or "x"
    common = {"model": model, "max_tokens": rng.randint(8, 64), "temperature": rng.choice([0.0, 0.8]),
              "n": 2 if rng.random() < 0.1 else 1}
    if rng.random() < 0.6:
        return "/v1/completions", {**common, "prompt": prompt}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}


async def one_request(client: httpx.AsyncClient, rng: random.Random, model: str, args, tally: Tally) -> None:
    path, body = request_body(rng, model)
    tally.requests += 1
    if rng.random() < args.abandon:  # non-streaming, abandoned while the server works on it
        try:
            resp = await client.post(path, json=body, timeout=httpx.Timeout(30.0, read=0.05))
            if resp.status_code != 200:
                tally.count(tally.http_errors, str(resp.status_code))
            else:
                tally.completed_non_streaming += 1
        except httpx.ReadTimeout:
            tally.abandoned_non_streaming += 1
        except httpx.HTTPError as exc:
            tally.count(tally.client_exceptions, type(exc).__name__)
        return
    cut_after = rng.randint(1, 4) if rng.random() < args.disconnect else None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                tally.count(tally.http_errors, str(resp.status_code))
                return
            chunks, done, finishes, usage = 0, False, {}, None
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    tally.in_band_errors += 1
                    continue
                chunks += 1
                for choice in event.get("choices", []):
                    if choice.get("finish_reason"):
                        finishes[choice["index"]] = choice["finish_reason"]
                usage = event.get("usage") or usage
                if cut_after is not None and chunks >= cut_after:
                    tally.disconnected_streams += 1
                    return  # leaving the block closes the connection mid-stream
            tally.completed_streams += 1
            tally.missing_done += not done
            n = body["n"]
            if sorted(finishes) != list(range(n)) or not set(finishes.values()) <= {"stop", "length"}:
                tally.bad_finish += 1
            if usage:
                tally.completion_tokens += usage["completion_tokens"]
    except httpx.HTTPError as exc:
        tally.count(tally.client_exceptions, type(exc).__name__)


async def run_load(url: str, model: str, args, tally: Tally, pid: int) -> list[tuple[int, float]]:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    rss = [(0, rss_mb(pid))]
    marks = {args.streams * k // 10 for k in range(1, 11)}
    next_index = iter(range(args.streams))
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0), limits=limits) as client:
        async def worker() -> None:
            for i in next_index:
                await one_request(client, random.Random(rng.random()), model, args, tally)
                if i + 1 in marks:
                    rss.append((i + 1, rss_mb(pid)))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return sorted(rss)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become healthy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=2000, help="requests to send after the warm-up")
    parser.add_argument("--disconnect", type=float, default=0.4, help="fraction of streams cut after 1-4 chunks")
    parser.add_argument("--abandon", type=float, default=0.03,
                        help="fraction of requests sent non-streaming and abandoned after 50 ms")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=200, help="requests of the same mix before measuring")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--log", default=None, help="the server's log file (default: a new file in the temp dir)")
    parser.add_argument("serve_args", nargs="*", help="flags for `conveyor serve` (after --)")
    args = parser.parse_args(argv)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(args.log or tempfile.mkstemp(prefix="conveyor-soak-", suffix=".log")[1])
    # the embedded bench model unless the serve flags name another (a later --model wins)
    cmd = [sys.executable, "-m", "conveyor", "serve", "--port", str(port), "--served-model-name", "soak",
           "--model", "conveyor-embedded-llama-40m-random", *args.serve_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    result: dict = {"command": " ".join(cmd), "streams": args.streams, "disconnect": args.disconnect,
                    "abandon": args.abandon, "concurrency": args.concurrency, "seed": args.seed}
    try:
        wait_healthy(url, proc)
        warm = Tally()
        warm_args = argparse.Namespace(**{**vars(args), "streams": args.warmup, "seed": args.seed + 1})
        warm_rss = asyncio.run(run_load(url, "soak", warm_args, warm, proc.pid))
        result["rss_mb_warmup"] = [(n, round(mb, 1)) for n, mb in warm_rss]
        aborts_before = _aborts(url)
        tally = Tally()
        start = time.monotonic()
        rss = asyncio.run(run_load(url, "soak", args, tally, proc.pid))
        result["wall_s"] = round(time.monotonic() - start, 1)
        first_poll = gauges(url)
        deadline = time.monotonic() + 10
        settled = first_poll
        while any(settled.get(name, 0.0) != 0.0 for name in GAUGES) and time.monotonic() < deadline:
            time.sleep(0.2)
            settled = gauges(url)
        health = httpx.get(url + "/health", timeout=10).status_code
        ordinary = httpx.post(url + "/v1/completions", json={"model": "soak", "prompt": "hello", "max_tokens": 4},
                              timeout=60).status_code
        result.update(warmup_tally=asdict(warm), tally=asdict(tally), rss_mb=[(n, round(mb, 1)) for n, mb in rss],
                      rss_growth_mb=round(rss[-1][1] - rss[0][1], 1), gauges_first_poll=first_poll,
                      gauges_settled=settled, health_after=health, ordinary_request_after=ordinary,
                      server_aborts=_aborts(url) - aborts_before)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            result["server_exit"] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            result["server_exit"] = "killed"
    log_text = log_path.read_text()
    noisy = [line for line in log_text.splitlines() if "Traceback" in line or line.startswith("ERROR")]
    result["log"] = str(log_path)
    result["log_error_lines"] = len(noisy)
    t, w = result.get("tally", {}), result.get("warmup_tally", {})
    checks = {
        "no HTTP errors": "tally" in result and not t["http_errors"] and not w["http_errors"],
        "no client exceptions": "tally" in result and not t["client_exceptions"] and not w["client_exceptions"],
        "no in-band errors": t.get("in_band_errors") == 0 and w.get("in_band_errors") == 0,
        "every completed stream well-formed": t.get("missing_done") == w.get("missing_done") == 0
        and t.get("bad_finish") == w.get("bad_finish") == 0,
        "gauges back to 0": all(result.get("gauges_settled", {}).get(g, 1.0) == 0.0 for g in GAUGES),
        "healthy and serving after": result.get("health_after") == result.get("ordinary_request_after") == 200,
        f"RSS growth < {args.max_rss_growth_mb:g} MB": result.get("rss_growth_mb", 1e9) < args.max_rss_growth_mb,
        "no traceback or ERROR in the server log": not noisy,
    }
    result["checks"] = checks
    result["passed"] = all(checks.values())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("checks", "passed")}))
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    for line in noisy[:10]:
        print("server log:", line, file=sys.stderr)
    return 0 if result["passed"] else 1


def _aborts(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "conveyor:request_success_total" and sample.labels.get("finished_reason") == "abort":
                return sample.value
    return 0.0


if __name__ == "__main__":
    sys.exit(main())
