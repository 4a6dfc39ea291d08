"""Batch-1 inter-token latency of two `conveyor serve` builds, alternated: one greedy stream at a time.

    python scripts/itl_ab.py --model DIR --other /path/to/another/checkout [--rounds 4] [-- serve flags]

The other build runs from a checkout given as ``PYTHONPATH`` (e.g. ``git worktree add /tmp/old <commit>``), in the
same virtual environment; both servers stay up, and the rounds alternate which one goes first. Prints the mean
and median ITL of every round (ms), as in docs/reliability.md ("The engine pipe").
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, extra: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "conveyor.cli", "serve", "--model", model, "--disable-log-stats", "--port", str(port),
           *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(0.3)
    raise SystemExit("the server was not ready in 600 s")


def itl(url: str, tokens: int) -> tuple[float, float]:
    arrivals = []
    body = {"prompt": [5, 6, 7, 8], "max_tokens": tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return statistics.mean(gaps) * 1e3, statistics.median(gaps) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--other", required=True, help="a checkout of the other build (used as PYTHONPATH)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("serve_args", nargs="*", help="flags for both servers, after --")
    ns = p.parse_args()
    servers = {"this": start(ns.model, ns.serve_args, {}),
               "other": start(ns.model, ns.serve_args, {"PYTHONPATH": ns.other})}
    try:
        for _, url in servers.values():
            itl(url, 50)  # warm-up
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
        for r in range(ns.rounds):
            for name in (["this", "other"] if r % 2 == 0 else ["other", "this"]):
                results[name].append(itl(servers[name][1], ns.tokens))
        for name, rows in results.items():
            print(f"{name}: " + "  ".join(f"{mean:.2f}/{median:.2f}" for mean, median in rows) + " ms (mean/median ITL)")
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
