"""1 vs 2 replicas, and pow2 vs prefix routing, on one shared-prefix trace, interleaved in rounds.

For each configuration: start ``conveyor serve`` (plain, or on Ray Serve with ``--data-parallel-size`` /
``--router``), warm it up with prompts that share nothing with the trace, read the summed prefix-cache counters
from ``/metrics``, replay the trace with ``conveyor bench serve``, read the counters again, stop the server.
Configurations alternate within each round (A/B/C, A/B/C, ...) so the machine's load hits them alike.

    .venv/bin/python scripts/scaleout_bench.py --workload /tmp/sp.json --rounds 2 -- --num-kv-blocks 192

Everything after ``--`` goes to every ``conveyor serve``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

CONFIGS = {
    # name: (serve flags, environment)
    "single-1cpu": ([], {"OMP_NUM_THREADS": "1"}),  # plain conveyor serve, no Ray, one thread
    "ray-1-replica": (["--autoscaling-config", '{"min_replicas": 1, "max_replicas": 1, "initial_replicas": 1}'], {}),
    "ray-2-pow2": (["--data-parallel-size", "2", "--router", "pow2"], {}),
    "ray-2-prefix": (["--data-parallel-size", "2", "--router", "prefix"], {}),
}
CONVEYOR = [sys.executable, "-m", "conveyor"]


def prefix_counters(url: str) -> tuple[float, float]:
    """Summed (queries, hits) of the prefix cache, in tokens (series without a ``replica`` label)."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if family.name in ("conveyor:prefix_cache_queries", "conveyor:prefix_cache_hits"):
            values[family.name] = sum(s.value for s in family.samples
                                      if s.name.endswith("_total") and "replica" not in s.labels)
    return values["conveyor:prefix_cache_queries"], values["conveyor:prefix_cache_hits"]


def wait_ready(url: str, proc: subprocess.Popen, replicas: int, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200 and (not r.content or len(r.json()["replicas"]) == replicas):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not become ready")


def warm_up(url: str) -> None:
    """A few requests per replica whose tokens share nothing with any trace (ids below 3 are never drawn)."""
    for i in range(6):
        httpx.post(url + "/v1/completions", timeout=120,
                   json={"prompt": [1, 2] * (20 + i), "max_tokens": 8, "ignore_eos": True}).raise_for_status()


def counters_settled(url: str) -> tuple[float, float]:
    """Counters once the replicas' reports have caught up (two reads 1.5 s apart agree)."""
    last = prefix_counters(url)
    while True:
        time.sleep(1.5)
        now = prefix_counters(url)
        if now == last:
            return now
        last = now


def run_one(name: str, workload: str, port: int, serve_args: list[str]) -> dict:
    flags, env = CONFIGS[name]
    url = f"http://127.0.0.1:{port}"
    cmd = CONVEYOR + ["serve", "--port", str(port), "--disable-log-stats", "--uvicorn-log-level", "warning",
                      *flags, *serve_args]
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, proc, 2 if "ray-2" in name else 1)
        warm_up(url)
        q0, h0 = counters_settled(url)
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run(CONVEYOR + ["bench", "serve", "--base-url", url, "--workload", workload,
                                       "--json", out.name], check=True, stdout=subprocess.DEVNULL)
            summary = json.load(open(out.name))["summary"]
        q1, h1 = counters_settled(url)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"config": name, "hit_rate": (h1 - h0) / max(q1 - q0, 1), "ttft_p50_ms": summary["ttft"]["p50"] * 1e3,
            "ttft_p99_ms": summary["ttft"]["p99"] * 1e3, "out_tok_s": summary["output_throughput"],
            "req_s": summary["request_throughput"], "failed": summary["num_failed"],
            "load": os.getloadavg()[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=8470)
    p.add_argument("--json", default=None, help="write every run's numbers here")
    p.add_argument("serve_args", nargs="*", help="after --: flags for every conveyor serve")
    ns = p.parse_args()
    names = ns.configs.split(",")
    runs = []
    for r in range(ns.rounds):
        for name in names:
            res = run_one(name, ns.workload, ns.port, ns.serve_args)
            res["round"] = r
            runs.append(res)
            print(json.dumps(res), file=sys.stderr, flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(runs, f, indent=1)
    print("| config | prefix-cache hit rate | TTFT p50 (ms) | TTFT p99 (ms) | out tok/s | failed | 1-min load |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        mine = [x for x in runs if x["config"] == name]

        def med(key):
            return statistics.median(x[key] for x in mine)

        print(f"| {name} | {med('hit_rate'):.1%} | {med('ttft_p50_ms'):.0f} | {med('ttft_p99_ms'):.0f} | "
              f"{med('out_tok_s'):.0f} | {sum(x['failed'] for x in mine)} | {med('load'):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
