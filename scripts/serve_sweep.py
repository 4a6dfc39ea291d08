"""Serving latency of two or more OpenAI-compatible servers over a range of request rates, measured in one run.

Each server is started from its own command line (``{port}`` in it is replaced), timed until it answers
``/v1/models`` ("ready after"), warmed up, and left running; then for every rate the same trace is replayed against
each server in turn by the same client (``conveyor bench serve``'s), the order alternating from rate to rate so
that neither server always runs first. The machine's load average is recorded before every replay.

    python scripts/serve_sweep.py --workload W.json --rates 2,4,8,16,inf --out sweep.json --plot sweep.png \\
        --server 'conveyor=conveyor serve --model M --port {port}' \\
        --server 'vllm=python vllm_cli.py serve M --port {port}'

``--plot`` draws TTFT, TPOT, ITL and E2E (p50 solid, p99 dashed) and goodput against the rate (matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx

from conveyor.bench.metrics import summarize
from conveyor.bench.serve_client import ServeBenchConfig, format_rows, run_bench
from conveyor.bench.workload import Workload, load_workload


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, command: str, log_dir: str, timeout_s: float) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    log = open(os.path.join(log_dir, f"{name}.log"), "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(shlex.split(command.format(port=port)), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                return proc, url, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout_s:
            proc.kill()
            raise RuntimeError(f"{name} not ready after {timeout_s:.0f} s; see {log.name}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(22, 4.2))
    names = list(result["servers"])
    for i, name in enumerate(names):
        # saturation (rate inf) has no place on a rate axis: it stays in the table and the JSON
        points = [p for p in result["points"] if p["server"] == name and math.isfinite(p["rate"])]
        rates = [p["rate"] for p in points]
        color = f"C{i}"
        for ax, key, unit in zip(axes, ("ttft", "tpot", "itl", "e2e"), ("ms", "ms", "ms", "s")):
            k = 1e3 if unit == "ms" else 1.0
            ax.plot(rates, [k * p["summary"][key]["p50"] for p in points], "o-", color=color, label=f"{name} p50")
            ax.plot(rates, [k * p["summary"][key]["p99"] for p in points], "s--", color=color, label=f"{name} p99")
            ax.set_title(f"{key.upper()} ({unit})")
        axes[4].plot(rates, [p["summary"]["goodput"] or 0.0 for p in points], "o-", color=color, label=name)
    axes[4].set_title("goodput (req/s within SLOs)")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[4].legend(fontsize=8)
    fig.suptitle(result["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", action="append", required=True, help="NAME=COMMAND ({port} is replaced)")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--rates", default="2,4,8,16")
    ap.add_argument("--warmup", type=int, default=40, help="requests sent at once to each server first")
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--title", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--log-dir", default="/tmp")
    ns = ap.parse_args()

    workload = load_workload(ns.workload)
    slo = {"ttft": ns.slo_ttft_ms, "tpot": ns.slo_tpot_ms}
    servers: dict[str, dict] = {}
    procs = []
    try:
        for spec in ns.server:
            name, _, command = spec.partition("=")
            proc, url, ready_s = start(name, command, ns.log_dir, ns.ready_timeout)
            procs.append(proc)
            servers[name] = {"command": command, "url": url, "ready_s": ready_s}
            print(f"[sweep] {name} ready after {ready_s:.1f} s at {url}", file=sys.stderr)
            cfg = ServeBenchConfig(url, request_rate=math.inf)
            asyncio.run(run_bench(Workload(workload.name, workload.requests[: ns.warmup], workload.seed), cfg))
        points = []
        names = list(servers)
        for i, rate in enumerate(float(r) for r in ns.rates.split(",")):
            order = names if i % 2 == 0 else names[::-1]
            rows = []
            for name in order:
                load = os.getloadavg()[0]
                cfg = ServeBenchConfig(servers[name]["url"], request_rate=rate, seed=0)
                timings, duration = asyncio.run(run_bench(workload, cfg))
                summary = summarize(timings, duration, slo).to_dict()
                points.append({"server": name, "rate": rate, "load_before": load, "summary": summary})
                rows.append((f"{name} @ {rate:g} req/s (load {load:.1f})", summary))
            print(format_rows(rows), flush=True)
    finally:
        for proc in procs:
            stop(proc)
    points.sort(key=lambda p: (p["server"], p["rate"]))
    result = {"title": ns.title, "workload": workload.name, "slo_ms": slo, "servers": servers, "points": points}
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=1)
    if ns.plot:
        plot(result, ns.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
