#!/usr/bin/env python3
"""Chat TPOT with and without embedding traffic in one server: ``conveyor serve --model CHAT --embedding-model
all-MiniLM-L6-v2`` (each model in its own engine process, the default layout), a streaming chat trace at 4 req/s,
in alternating rounds alone and beside closed-loop embedding clients, and those clients alone.

    python benchmarks/embed_chat_tpot.py [--chat-model conveyor-embedded-llama-40m-random] [--rounds 2] \
        [--num-requests 40] [--request-rate 4] [--embed-clients 2] [--embed-batch 16] [--threads 2] \
        [--embedding-cpu-priority auto|idle|low|normal]

The chat requests are the first ``--num-requests`` of ``longtail_v1`` (``conveyor bench serve``'s client and
metrics: TPOT as vLLM defines it), sent at ``--request-rate`` req/s (Poisson, the same seed every round). In the
"with embeddings" rounds, ``--embed-clients`` clients post ``/v1/embeddings`` requests of ``--embed-batch`` passages
of 20-256 tokens (``benchmarks/embed_throughput.py``'s, up to the served limit) back to back for as long as the chat trace runs; their
passages/s is printed, and again in "embeddings alone" rounds (``--embed-alone-s`` seconds without chat). Prints TPOT
p50 / p99 per round and the medians; report ``uptime`` beside them.
``--embedding-cpu-priority`` is passed to ``conveyor serve`` (auto: the embedding engine at SCHED_IDLE).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

from benchmarks.embed_throughput import make_passages, minilm_dir


def start_server(chat_model: str, threads: int, port: int, priority: str) -> subprocess.Popen:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        raise SystemExit(f"something already serves port {port}: pass another --port")
    except OSError:
        pass  # free, as it should be
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", chat_model, "--embedding-model", minilm_dir(),
           "--embedding-served-model-name", "minilm", "--embedding-cpu-priority", priority,
           "--num-threads", str(threads), "--host", "127.0.0.1",
           "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}): {' '.join(cmd)}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


async def embed_loop(base_url: str, passages: list[str], batch: int, stop: asyncio.Event, done: list[int]) -> None:
    """Post batches of passages back to back until ``stop``; count the embedded passages in ``done``."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        i = 0
        while not stop.is_set():
            chunk = [passages[(i + j) % len(passages)] for j in range(batch)]
            i += batch
            resp = await client.post("/v1/embeddings", json={"model": "minilm", "input": chunk})
            if resp.status_code != 200:
                raise SystemExit(f"/v1/embeddings answered {resp.status_code}: {resp.text[:300]}")
            if not stop.is_set():  # a request that ends after the chat trace is not counted
                done[0] += len(resp.json()["data"])


async def one_round(base_url: str, chat_model: str, workload, rate: float, mode: str, ns,
                    passages: list[str]) -> dict:
    """One round in ``mode`` (a key of ``MODES``): the chat trace and/or the embedding clients."""
    from conveyor.bench.metrics import summarize
    from conveyor.bench.serve_client import ServeBenchConfig, run_bench

    chat, embed = MODES[mode]
    stop, done = asyncio.Event(), [0]
    loops = [asyncio.create_task(embed_loop(base_url, passages, ns.embed_batch, stop, done))
             for _ in range(ns.embed_clients if embed else 0)]
    if loops:
        await asyncio.sleep(1.0)  # the embedding engine busy before the first chat request
    start, done[0] = time.perf_counter(), 0
    if chat:
        timings, duration = await run_bench(workload, ServeBenchConfig(base_url, chat_model, rate, seed=ns.seed))
    else:
        await asyncio.sleep(ns.embed_alone_s)
    elapsed = time.perf_counter() - start
    stop.set()
    await asyncio.gather(*loops)
    result = {"embed_passages_s": done[0] / elapsed}
    if chat:
        s = summarize(timings, duration)
        if s.num_failed:
            raise SystemExit(f"{s.num_failed} chat request(s) failed: {next(t.error for t in timings if t.error)}")
        result.update(tpot_p50_ms=s.tpot.p50 * 1000, tpot_p99_ms=s.tpot.p99 * 1000, ttft_p50_ms=s.ttft.p50 * 1000)
    return result


MODES = {"chat alone": (True, False), "chat + embeddings": (True, True), "embeddings alone": (False, True)}


def describe(res: dict) -> str:
    chat = (f"TPOT p50 {res['tpot_p50_ms']:.1f} ms, p99 {res['tpot_p99_ms']:.1f} ms, TTFT p50 {res['ttft_p50_ms']:.0f} "
            "ms; " if "tpot_p50_ms" in res else "")
    return f"{chat}embeddings {res['embed_passages_s']:.1f} passages/s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chat-model", default="conveyor-embedded-llama-40m-random")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--embed-clients", type=int, default=2)
    ap.add_argument("--embed-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--port", type=int, default=8937)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--embed-alone-s", type=float, default=10.0, help="length of an embeddings-alone round")
    ap.add_argument("--embedding-cpu-priority", default="auto", choices=("auto", "idle", "low", "normal"))
    ns = ap.parse_args()
    from conveyor.bench.workload import Workload, load_workload
    from conveyor.tokenizer import load_tokenizer

    trace = load_workload("longtail_v1")
    workload = Workload(trace.name, trace.requests[:ns.num_requests], trace.seed)
    passages = make_passages(load_tokenizer(minilm_dir()), 512, 20, 256)  # the server's limit: MiniLM's 256
    server = start_server(ns.chat_model, ns.threads, ns.port, ns.embedding_cpu_priority)
    base_url = f"http://127.0.0.1:{ns.port}"
    print(f"chat: {ns.chat_model}, {len(workload.requests)} requests of longtail_v1 at {ns.request_rate:g} req/s; "
          f"embeddings: {ns.embed_clients} clients x {ns.embed_batch} passages, CPU priority "
          f"{ns.embedding_cpu_priority}; uptime: "
          f"{os.popen('uptime').read().strip()}", flush=True)
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        served = [m["id"] for m in json.load(urllib.request.urlopen(base_url + "/v1/models"))["data"]]
        chat = next(m for m in served if m != "minilm")
        warm = Workload(workload.name, workload.requests[:4], workload.seed)
        asyncio.run(one_round(base_url, chat, warm, float("inf"), "chat + embeddings", ns, passages))  # every kernel
        for r in range(ns.rounds):
            for name in results:
                res = asyncio.run(one_round(base_url, chat, workload, ns.request_rate, name, ns, passages))
                results[name].append(res)
                print(f"round {r + 1}: {name}: {describe(res)}; uptime: {os.popen('uptime').read().strip()}",
                      flush=True)
    finally:
        server.terminate()
        server.wait(60)
    for name, runs in results.items():
        print(f"median {name}: {describe({k: statistics.median(r[k] for r in runs) for k in runs[0]})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
