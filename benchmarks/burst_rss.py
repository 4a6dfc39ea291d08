#!/usr/bin/env python3
"""Peak resident memory of a server under the trace's burst, per process: ``conveyor serve`` (one or more
checkouts) against llama.cpp's ``llama-server`` on the same GGUF file, with ``gguf_side_by_side.py``'s command
lines (the same context for llama-server: 32 slots of the trace's longest request).

    python benchmarks/burst_rss.py --gguf PATH/model.gguf [--llama-server PATH/llama-server] \
        [--tree PATH/checkout ...] [--num-requests 100] [--threads 2] [--conveyor-arg=...]

Each server is started alone, its resident set read once it answers ``/health`` (idle) and then sampled every
0.1 s, process by process (for conveyor the API process and the engine core process, the tree summed too), while
``--warmup`` requests and then the first ``--num-requests`` of the trace are sent at once. ``--tree`` runs
``conveyor serve`` from another checkout (``PYTHONPATH`` set to it; default: this one), so a change's before and
after take turns in one run. Only memory is measured: the burst's wall time is printed, not compared.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import gguf_side_by_side as sbs  # noqa: E402
from conveyor.bench.serve_client import ServeBenchConfig, run_bench  # noqa: E402
from conveyor.bench.workload import Workload, load_workload  # noqa: E402


class ProcessPeaks:
    """Peak RSS of each process of a tree (by role: the root, then its children by start order) and of the tree
    summed, sampled in a thread every ``interval_s``."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> dict[str, int]:
        """RSS now, bytes: {"server": root, "child N": ..., "tree": sum}."""
        import psutil

        try:
            root = psutil.Process(self.pid)
            children = sorted(root.children(recursive=True), key=lambda p: p.create_time())
        except psutil.Error:
            return {}
        out = {}
        for name, p in [("server", root), *((f"child {i + 1}", c) for i, c in enumerate(children))]:
            try:
                out[name] = p.memory_info().rss
            except psutil.Error:
                pass
        out["tree"] = sum(out.values())
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, rss in self.sample().items():
                self.peaks[name] = max(self.peaks.get(name, 0), rss)
            self._stop.wait(self.interval_s)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(5)
        return self.peaks


def run_one(name: str, cmd: list[str], port: int, env: dict | None, workload: Workload, ns,
            cwd: str = sbs.REPO) -> dict:
    server = sbs.Server(name, cmd, port, tempfile.mkdtemp(prefix="burst-rss-"), env, cwd)
    try:
        server.wait_ready(ns.ready_timeout)
        idle = ProcessPeaks(server.proc.pid).sample()
        peaks = ProcessPeaks(server.proc.pid)
        warm = Workload(workload.name, workload.requests[: ns.warmup], workload.seed)
        asyncio.run(run_bench(warm, ServeBenchConfig(server.url, request_rate=math.inf)))
        timings, duration = asyncio.run(run_bench(workload, ServeBenchConfig(server.url, request_rate=math.inf)))
        short = sbs.short_requests(workload, timings)
        peak = peaks.stop()
    finally:
        server.stop()
    row = dict(name=name, idle=idle, peak=peak, burst_s=duration, short=len(short))
    print(f"[burst rss] {row}", file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--tree", action="append", default=[], help="a conveyor checkout to serve from (repeatable)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--trace", default=sbs.DEFAULT_TRACE)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--output-tokens", type=int, default=128, help="as gguf_side_by_side.py's (llama's context)")
    ap.add_argument("--conveyor-arg", action="append", default=[], metavar="ARG")
    ap.add_argument("--llama-server-arg", action="append", default=[], metavar="ARG")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ns = ap.parse_args(argv)
    workload = load_workload(ns.trace)
    # llama-server's context: the whole trace's (as gguf_side_by_side.py gives it), however many requests are sent
    ctx = sbs.slot_context(workload, ns.output_tokens, sbs.batch1_prompt(workload).prompt_len)
    if ns.num_requests:
        workload = Workload(workload.name, workload.requests[: ns.num_requests], workload.seed)
    rows = []
    for tree in ns.tree or [sbs.REPO]:
        port = sbs.free_port()
        tree = os.path.abspath(tree)  # also the server's working directory: `python -m` imports from there first
        env = {**os.environ, "PYTHONPATH": tree}
        rows.append(run_one(f"conveyor ({os.path.basename(tree)})", sbs.conveyor_cmd(ns.gguf, port, ns.threads,
                            ns.conveyor_arg), port, env, workload, ns, tree))
    if ns.llama_server:
        port = sbs.free_port()
        rows.append(run_one("llama-server", sbs.llama_server_cmd(ns.llama_server, ns.gguf, port, ns.threads, ctx,
                                                                 ns.llama_server_arg), port, None, workload, ns))
    gib = 2**30
    print(f"{os.path.basename(ns.gguf)}, {len(workload.requests)} requests at once")
    print("| server | idle: processes (GiB) | idle tree | peak: processes (GiB) | peak tree | burst s |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        def procs(d: dict) -> str:
            return " / ".join(f"{v / gib:.2f}" for k, v in d.items() if k != "tree")
        print(f"| {r['name']} | {procs(r['idle'])} | {r['idle']['tree'] / gib:.2f} | {procs(r['peak'])} | "
              f"{r['peak']['tree'] / gib:.2f} | {r['burst_s']:.1f}{' !' if r['short'] else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
