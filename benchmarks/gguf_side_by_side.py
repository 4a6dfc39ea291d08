#!/usr/bin/env python3
"""conveyor serve against llama.cpp's llama-server, side by side: the same GGUF files, the same trace, the same
streaming client (``conveyor bench serve``'s), one server after the other.

    python benchmarks/gguf_side_by_side.py --gguf PATH/model.Q4_1.gguf [--gguf PATH/model.Q8_0.gguf] \
        [--llama-server PATH/llama-server] [--llama-bench PATH/llama-bench] [--threads 2] \
        [--num-requests 100] [--rate 4] [--output-tokens 128] [--conveyor-arg=--quantization=none] \
        [--llama-server-arg=--cache-prompt] [--json out.json]

For every (server, GGUF file) the server is started alone on 127.0.0.1 at a free port, waited for (``/health``
200), warmed up with ``--warmup`` of the trace's requests at once (unmeasured), then measured three ways, and
stopped (its whole process group) before the next one starts, so the two never share the cores:

- burst: the whole trace sent at t=0; wall time and output tokens per second;
- online: the trace at ``--rate`` req/s (Poisson arrivals, seed 0); TTFT, TPOT and ITL p50 / p99;
- batch-1 decode: one streaming request of ``--output-tokens`` tokens with ``ignore_eos``, alone;
  tok/s = (tokens - 1) / (last token time - first token time), so prefill is left out; ``--batch1-repeats``
  such requests one after another (the cell: their median, then their range);

and the peak RSS of the server's process tree (the server and every descendant, summed), sampled with psutil
every 0.1 s for its whole run. Without ``--llama-server`` only conveyor runs. ``--llama-bench`` adds llama.cpp's
own decode number per file (``llama-bench -p 0 -n 128``, tg128), which has no HTTP, sampling or scheduler in it.

llama-server runs with ``-t N -tb N --parallel 32 -cb`` and ``-c`` = 32 x the per-slot context the longest
request needs (llama-server splits ``-c`` evenly over its slots when ``--parallel`` is given), so up to 32
requests decode together and none is cut short by a full slot.

Prompt caches are off in both servers (conveyor ``--no-enable-prefix-caching``; llama-server ``--no-cache-prompt
--cache-ram 0``): the warm-up, the burst, the online replay and the batch-1 request send the same prompts again,
and with a cache on the later phases would measure prefill of cached prompts, by each server's own reuse rules
(llama-server's 32 slots keep their last prompt and a host-memory prompt cache of up to 8 GiB by default, which
also counts in its RSS). ``--conveyor-arg=--enable-prefix-caching`` and ``--llama-server-arg=--cache-prompt
--llama-server-arg=--cache-ram --llama-server-arg=8192`` turn them back on. Every phase checks that each request
completed with exactly its ``max_tokens`` (``ignore_eos``); a cell whose phase did not is marked ``!``.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from urllib.parse import urlsplit

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:  # run as a script from anywhere: import conveyor from this checkout
    sys.path.insert(0, REPO)

from conveyor.bench.metrics import summarize  # noqa: E402
from conveyor.bench.serve_client import ServeBenchConfig, run_bench  # noqa: E402
from conveyor.bench.workload import Workload, WorkloadRequest, load_workload  # noqa: E402

DEFAULT_TRACE = os.path.join(REPO, "conveyor", "bench", "traces", "longtail_v1.json")  # side_by_side.py's
LLAMA_SLOTS = 32
CTX_ROUND = 256  # llama-server's per-slot context is rounded up to this (a whole number of KV pages)


# ---- a server subprocess -----------------------------------------------------------------------------------
def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RssSampler:
    """Peak RSS of a process and all its descendants (summed), sampled in a thread every ``interval_s``.
    The tree is re-read at every sample, because a server starts its children (conveyor's engine core) after
    it has started itself."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid, self.interval_s, self.peak_bytes = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> int:
        """The tree's RSS now, bytes (0 once the process is gone)."""
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:  # a child that exited between the listing and the read
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self.sample())
            self._stop.wait(self.interval_s)

    def stop(self) -> int:
        """Stop sampling (after one last sample); the peak, bytes."""
        self.peak_bytes = max(self.peak_bytes, self.sample())
        self._stop.set()
        self._thread.join(5)
        return self.peak_bytes


class Server:
    """A server command run in a session (process group) of its own, logging to a file; ``wait_ready`` polls
    ``/health``, ``stop`` ends the whole group (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, cmd: list[str], port: int, log_dir: str, env: dict | None = None,
                 cwd: str = REPO) -> None:
        self.name, self.cmd, self.url = name, cmd, f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(log_dir, f"{name}-{port}.log")
        with open(self.log_path, "w") as log:
            # a new session: the group can be killed as one, engine core and OpenMP threads' process included
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=env, cwd=cwd)
        self.rss = RssSampler(self.proc.pid)
        self.started = time.monotonic()

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def wait_ready(self, timeout_s: float) -> float:
        """Wait until ``/health`` answers 200 (llama-server answers 503 while it loads); seconds waited."""
        import httpx

        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} at start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            if time.monotonic() - self.started > timeout_s:
                raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 30.0) -> float:
        """End the process group; the tree's peak RSS over the whole run, GiB."""
        peak = self.rss.stop()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout_s)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        return peak / 2**30


# ---- the two servers' command lines ------------------------------------------------------------------------
def slot_context(workload: Workload, output_tokens: int, batch1_prompt_len: int) -> int:
    """The context one llama-server slot needs for the longest request of this run (the trace's and the
    batch-1 request), rounded up to ``CTX_ROUND``."""
    need = max([r.prompt_len + r.max_tokens for r in workload.requests] + [batch1_prompt_len + output_tokens])
    return CTX_ROUND * math.ceil(need / CTX_ROUND)


def llama_server_cmd(binary: str, gguf: str, port: int, threads: int, per_slot_ctx: int,
                     extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """llama-server with 32 continuously batched slots, each ``per_slot_ctx`` tokens of context, no prompt cache,
    and ``extra`` (``--llama-server-arg``) last so they override."""
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "--parallel", str(LLAMA_SLOTS), "-cb", "-c", str(LLAMA_SLOTS * per_slot_ctx), "--no-webui",
            "--no-cache-prompt", "--cache-ram", "0", *extra]


def conveyor_cmd(gguf: str, port: int, threads: int, extra: list[str]) -> list[str]:
    """``conveyor serve`` on the GGUF file, from this checkout, prefix caching off, with ``extra``
    (``--conveyor-arg``) last so they override."""
    return [sys.executable, "-m", "conveyor", "serve", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--num-threads", str(threads), "--disable-log-stats", "--no-enable-prefix-caching", *extra]


# ---- the measurements --------------------------------------------------------------------------------------
def batch1_prompt(workload: Workload) -> WorkloadRequest:
    """The batch-1 request's prompt: the trace's first request's, so both servers get the same tokens."""
    return workload.requests[0]


def batch1_decode(url: str, req: WorkloadRequest, output_tokens: int, timeout_s: float = 600.0) -> dict:
    """One streaming completion of ``output_tokens`` tokens with ``ignore_eos``, alone on the server; decode
    tok/s = (tokens - 1) / (last token time - first token time).

    Every chunk with choices is a token arrival (the serve client's rule, vLLM's). llama-server ends a stream
    with an extra chunk of empty text that only carries ``finish_reason``; it is sent in the same server step as
    the last token's chunk, so taking it as the last arrival moves the end by microseconds (``tail_gap_s``
    records that gap), while dropping empty chunks could drop a real last token whose text conveyor holds back
    or that decodes to nothing.

    The reader is the standard library's blocking ``http.client``, not the burst's asyncio client: on a machine
    whose cores the server computes on, the client's own CPU per token is taken from the server it measures, and
    httpx's asyncio streaming spent 0.59-0.75 ms of CPU a token where this reader spends 0.12-0.16 (AMD Zen 4,
    2 vCPU, a 256-token stream from conveyor serving the Q8_0 file at 126-147 tok/s)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        conn.request("GET", "/v1/models")
        models = conn.getresponse()
        model = json.loads(models.read())["data"][0]["id"]
        body = {"model": model, "max_tokens": output_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0,
                "prompt": req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt}
        times, usage_tokens = [], None
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"batch-1 request: HTTP {resp.status}: {resp.read()[:300]!r}")
        while line := resp.readline():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter() - t0
            chunk = json.loads(data)
            if chunk.get("choices"):
                times.append(now)
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
    finally:
        conn.close()
    tokens = usage_tokens or len(times)
    span = times[-1] - times[0] if len(times) > 1 else float("nan")
    return dict(tokens=tokens, chunks=len(times), ttft_s=times[0] if times else float("nan"), decode_s=span,
                tail_gap_s=times[-1] - times[-2] if len(times) > 1 else float("nan"),
                tok_s=(tokens - 1) / span if span > 0 else float("nan"),
                ignore_eos_honoured=tokens == output_tokens)  # a server that stopped at EOS gave fewer tokens


def replay(url: str, workload: Workload, rate: float) -> dict:
    """The trace against ``url`` at ``rate`` req/s (inf: all at t=0); the serve client's summary, as a dict."""
    cfg = ServeBenchConfig(url, request_rate=rate, seed=0)
    timings, duration = asyncio.run(run_bench(workload, cfg))
    summary = summarize(timings, duration).to_dict()
    summary["short"] = short_requests(workload, timings)
    if summary["short"]:
        first = next(t for t in timings if t.request_id == summary["short"][0])
        print(f"  {len(summary['short'])} request(s) failed or gave fewer / more tokens than max_tokens; first: "
              f"{first.request_id}: {first.error or f'{first.output_tokens} tokens'}", file=sys.stderr, flush=True)
    return summary


def short_requests(workload: Workload, timings: list) -> list[str]:
    """Ids of the requests that failed or did not give exactly their ``max_tokens`` (the trace asks for
    ``ignore_eos``, so a server that stops at EOS, or cuts a request at a full slot, does less work than the
    other and its throughput would not compare)."""
    want = {str(r.id): r.max_tokens for r in workload.requests}
    return [t.request_id for t in timings if not t.completed or t.output_tokens != want[t.request_id]]


def measure(server: Server, workload: Workload, ns: argparse.Namespace) -> dict:
    """Warm-up, burst, online at ``--rate``, batch-1 decode, against a server that is up."""
    if ns.warmup:
        warm = Workload(workload.name, workload.requests[: ns.warmup], workload.seed)
        asyncio.run(run_bench(warm, ServeBenchConfig(server.url, request_rate=math.inf)))
    out = {}
    t = time.monotonic()
    out["burst"] = replay(server.url, workload, math.inf)
    print(f"  burst: {out['burst']['duration_s']:.2f} s ({time.monotonic() - t:.1f} s)", file=sys.stderr, flush=True)
    out["online"] = replay(server.url, workload, ns.rate)
    print(f"  online at {ns.rate:g} req/s: done", file=sys.stderr, flush=True)
    runs = [batch1_decode(server.url, batch1_prompt(workload), ns.output_tokens)
            for _ in range(max(1, ns.batch1_repeats))]
    out["batch1"] = batch1_summary(runs)
    rates = ", ".join(f"{r['tok_s']:.1f}" for r in runs)
    print(f"  batch-1: {rates} tok/s ({runs[0]['tokens']} tokens)", file=sys.stderr, flush=True)
    return out


def batch1_summary(runs: list[dict]) -> dict:
    """The batch-1 requests of one server as one result: the median run's numbers (its ``tok_s`` the median
    rate), ``tok_s_min`` / ``tok_s_max``, every run in ``runs``, and whether every run honoured ``ignore_eos``."""
    ranked = sorted(runs, key=lambda r: r["tok_s"])
    rates = [r["tok_s"] for r in ranked]
    median = rates[len(rates) // 2] if len(rates) % 2 else (rates[len(rates) // 2 - 1] + rates[len(rates) // 2]) / 2
    return dict(ranked[len(ranked) // 2], tok_s=median, tok_s_min=rates[0], tok_s_max=rates[-1], runs=runs,
                ignore_eos_honoured=all(r["ignore_eos_honoured"] for r in runs))


def run_server(name: str, cmd: list[str], gguf: str, workload: Workload, ns, log_dir: str,
               port: int, env: dict | None = None) -> dict:
    """Start one server, measure it, always stop it; one result row."""
    print(f"[gguf side by side] {name} on {os.path.basename(gguf)}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    server = Server(name, cmd, port, log_dir, env)
    try:
        ready_s = server.wait_ready(ns.ready_timeout)
        print(f"  ready after {ready_s:.1f} s", file=sys.stderr, flush=True)
        res = measure(server, workload, ns)
    finally:
        rss_gib = server.stop()
    return dict(server=name, gguf=gguf, command=cmd, ready_s=ready_s, rss_gib=rss_gib, log=server.log_path, **res)


# ---- llama-bench -------------------------------------------------------------------------------------------
def parse_llama_bench(text: str) -> dict[str, float]:
    """``llama-bench -o json`` output -> tok/s by test name: "tg128" for ``n_prompt 0, n_gen 128``, "pp512" for
    ``n_prompt 512, n_gen 0`` (``avg_ts``, the mean over its repetitions)."""
    out = {}
    for entry in json.loads(text):
        n_prompt, n_gen = entry.get("n_prompt", 0), entry.get("n_gen", 0)
        name = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0 else f"pp{n_prompt}+tg{n_gen}"
        out[name] = float(entry["avg_ts"])
    return out


def run_llama_bench(binary: str, gguf: str, threads: int, tokens: int = 128,
                    repetitions: int | None = None) -> dict[str, float]:
    """``llama-bench -m GGUF -p 0 -n TOKENS -t THREADS [-r REPETITIONS] -o json``, parsed ({"tg128": tok/s})."""
    reps = [] if repetitions is None else ["-r", str(repetitions)]
    proc = subprocess.run([binary, "-m", gguf, "-p", "0", "-n", str(tokens), "-t", str(threads), *reps, "-o", "json"],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return parse_llama_bench(proc.stdout)


# ---- the table ---------------------------------------------------------------------------------------------
def format_table(rows: list[dict]) -> str:
    """One markdown row per (server, GGUF file)."""
    lines = ["| server | GGUF | burst wall s | burst out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
             "| ITL p50 / p99 ms | batch-1 decode tok/s | peak RSS GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, o = r["burst"], r["online"]

        def ms(key: str) -> str:
            return f"{1e3 * o[key]['p50']:.1f} / {1e3 * o[key]['p99']:.1f}"

        def bad(phase: dict) -> str:  # some request of this phase failed or stopped early: numbers don't compare
            return " !" if phase.get("short") else ""

        b1 = r["batch1"]
        b1s = f"{b1['tok_s']:.1f}" + ("" if b1["ignore_eos_honoured"] else f" ({b1['tokens']} tokens!)")
        if len(b1.get("runs", ())) > 1:
            b1s += f" ({b1['tok_s_min']:.1f}-{b1['tok_s_max']:.1f})"
        lines.append(f"| {r['server']} | {os.path.basename(r['gguf'])} | {b['duration_s']:.2f}{bad(b)} "
                     f"| {b['output_throughput']:.1f}{bad(b)} | {ms('ttft')}{bad(o)} | {ms('tpot')}{bad(o)} "
                     f"| {ms('itl')}{bad(o)} | {b1s} | {r['rss_gib']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", action="append", required=True, help="a GGUF file both servers load (repeatable)")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (without: conveyor only)")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary: also print its tg128")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="compute threads of each server")
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="a trace file or packaged trace name")
    ap.add_argument("--num-requests", type=int, default=None, help="use only the trace's first N requests")
    ap.add_argument("--rate", type=float, default=4.0, help="req/s of the online replay (Poisson)")
    ap.add_argument("--output-tokens", type=int, default=128, help="tokens of the batch-1 decode request")
    ap.add_argument("--batch1-repeats", type=int, default=3,
                    help="batch-1 requests, one after another (the table gives their median and range)")
    ap.add_argument("--warmup", type=int, default=4, help="trace requests sent at once, unmeasured, first")
    ap.add_argument("--conveyor-arg", action="append", default=[], metavar="ARG",
                    help="passed to conveyor serve (repeatable; write --conveyor-arg=--flag=value)")
    ap.add_argument("--llama-server-arg", action="append", default=[], metavar="ARG",
                    help="passed to llama-server (repeatable; write --llama-server-arg=--flag=value)")
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a server may take to start")
    ap.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write the raw numbers here too")
    ns = ap.parse_args(argv)

    workload = load_workload(ns.trace)
    if ns.num_requests is not None:
        workload = replace(workload, requests=workload.requests[: ns.num_requests])
    log_dir = ns.log_dir or tempfile.mkdtemp(prefix="gguf-side-by-side-")
    per_slot = slot_context(workload, ns.output_tokens, batch1_prompt(workload).prompt_len)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    rows, bench = [], {}
    for gguf in ns.gguf:
        gguf = os.path.abspath(gguf)
        port = free_port()
        rows.append(run_server("conveyor", conveyor_cmd(gguf, port, ns.threads, ns.conveyor_arg), gguf, workload,
                               ns, log_dir, port, env))
        if ns.llama_server:
            port = free_port()
            cmd = llama_server_cmd(ns.llama_server, gguf, port, ns.threads, per_slot, ns.llama_server_arg)
            rows.append(run_server("llama.cpp", cmd, gguf, workload, ns, log_dir, port))
        if ns.llama_bench:  # after the servers have stopped: never two on the cores at once
            bench[gguf] = run_llama_bench(ns.llama_bench, gguf, ns.threads)

    print(f"\n{len(workload.requests)} requests of {workload.name}; burst: all at t=0; online: {ns.rate:g} req/s; "
          f"batch-1: {ns.output_tokens} tokens, median of {ns.batch1_repeats}; {ns.threads} threads\n")
    print(format_table(rows))
    for gguf, tests in bench.items():
        print(f"\nllama-bench {os.path.basename(gguf)}: tg128 {tests.get('tg128', float('nan')):.1f} tok/s")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(dict(trace=workload.name, num_requests=len(workload.requests), rate=ns.rate,
                           output_tokens=ns.output_tokens, batch1_repeats=ns.batch1_repeats, threads=ns.threads, llama_slot_ctx=per_slot, rows=rows,
                           llama_bench=bench), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
