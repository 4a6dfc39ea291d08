#!/usr/bin/env python3
"""One streaming chat request at a time, ``conveyor serve`` against ``llama-server`` on the same GGUF and context,
read by the ``openai`` client as a chat window reads it, in paired rounds.

    python benchmarks/chat_stream_paired.py --gguf PATH/model.gguf --llama-server PATH/llama-server \
        [--rounds 4] [--streams 2] [--output-tokens 256] [--context 4096] [--threads 2] \
        [--conveyor-arg=...] [--llama-server-arg=...]

Both servers serve the file for the whole run on 127.0.0.1 (``--context`` tokens: conveyor's ``--max-model-len``,
llama-server's ``-c`` with one slot), idle while the other streams. A round is ``--streams`` chat completions
(greedy, ``ignore_eos``, ``max_tokens`` ``--output-tokens``, ``stream_options.include_usage``) to each server, the
order alternating from round to round. A stream's rate is what the client sees: completion tokens after the first
over the time from the first content chunk to the last chunk with choices. A round's ratio is conveyor's median
stream over llama-server's; the summary is the rounds' median and range. Beside each rate, the CPU time the
server's process tree (and of it, the first process: conveyor's API server, all of llama-server) and the client
spent per token (``psutil``; on two cores every millisecond of it is taken
from the decode it measures).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import gguf_side_by_side as sbs  # noqa: E402
from batch1_paired import summarize  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle. Describe every day of the voyage."


def tree_cpu_s(pid: int) -> tuple[float, float]:
    """User + system CPU seconds so far (threads included) of a process, and of its descendants (conveyor's
    engine process; none for llama-server)."""
    root = psutil.Process(pid)
    out = []
    for procs in ([root], root.children(recursive=True)):
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        out.append(total)
    return out[0], out[1]


def chat_stream(url: str, pid: int, output_tokens: int, timeout_s: float = 600.0) -> dict:
    """One streaming chat completion read by the openai client: the client-side decode rate, TTFT, and the CPU
    per token of the server's tree and of this client."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=timeout_s, max_retries=0)
    model = client.models.list().data[0].id
    server_cpu0, client_cpu0 = tree_cpu_s(pid), time.process_time()
    t0 = time.perf_counter()
    first = last = None
    usage_tokens, content_chunks = None, 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=output_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        now = time.perf_counter() - t0
        if chunk.choices:
            if chunk.choices[0].delta.content:
                content_chunks += 1
                first = now if first is None else first
            last = now
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
    client_cpu = time.process_time() - client_cpu0
    server_cpu = [b - a for a, b in zip(server_cpu0, tree_cpu_s(pid))]
    client.close()
    tokens = usage_tokens or content_chunks
    span = (last - first) if first is not None and last is not None else float("nan")
    return dict(tokens=tokens, ttft_s=first, tok_s=(tokens - 1) / span if span > 0 else float("nan"),
                server_cpu_ms_per_token=1e3 * sum(server_cpu) / max(tokens, 1),
                front_cpu_ms_per_token=1e3 * server_cpu[0] / max(tokens, 1),
                client_cpu_ms_per_token=1e3 * client_cpu / max(tokens, 1),
                ignore_eos_honoured=tokens == output_tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--streams", type=int, default=2, help="streams per server per round (their median counts)")
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--context", type=int, default=4096, help="context tokens, the same for both servers")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--conveyor-arg", action="append", default=[], metavar="ARG")
    ap.add_argument("--llama-server-arg", action="append", default=[], metavar="ARG")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ns = ap.parse_args(argv)

    log_dir = tempfile.mkdtemp(prefix="chat-stream-paired-")
    port_c, port_l = sbs.free_port(), sbs.free_port()
    conveyor_cmd = sbs.conveyor_cmd(ns.gguf, port_c, ns.threads,
                                    ["--max-model-len", str(ns.context), *ns.conveyor_arg])
    llama_cmd = [ns.llama_server, "-m", ns.gguf, "--host", "127.0.0.1", "--port", str(port_l), "-t", str(ns.threads),
                 "-tb", str(ns.threads), "--parallel", "1", "-c", str(ns.context), "--no-webui", *ns.llama_server_arg]
    servers = {"conveyor": sbs.Server("conveyor", conveyor_cmd, port_c, log_dir),
               "llama-server": sbs.Server("llama-server", llama_cmd, port_l, log_dir)}
    ratios, rates = [], {name: [] for name in servers}
    try:
        for server in servers.values():
            server.wait_ready(ns.ready_timeout)
            chat_stream(server.url, server.proc.pid, 16)  # warm-up, unmeasured
        names = list(servers)
        for r in range(ns.rounds):
            runs = {name: [] for name in names}
            for name in (names if r % 2 == 0 else names[::-1]):
                server = servers[name]
                runs[name] = [chat_stream(server.url, server.proc.pid, ns.output_tokens) for _ in range(ns.streams)]
                if not all(run["ignore_eos_honoured"] for run in runs[name]):
                    raise RuntimeError(f"{name}: a stream ended before its max_tokens (ignore_eos not honoured)")
            med = {name: statistics.median(run["tok_s"] for run in runs[name]) for name in names}
            for name in names:
                rates[name].append(med[name])
            ratios.append(med["conveyor"] / med["llama-server"])
            print(f"round {r + 1}: " + "; ".join(
                f"{name} {med[name]:.1f} tok/s (server CPU "
                f"{statistics.median(x['server_cpu_ms_per_token'] for x in runs[name]):.2f} ms/token, of which its first "
                f"process {statistics.median(x['front_cpu_ms_per_token'] for x in runs[name]):.2f}; client "
                f"{statistics.median(x['client_cpu_ms_per_token'] for x in runs[name]):.2f}, TTFT "
                f"{1e3 * statistics.median(x['ttft_s'] for x in runs[name]):.0f} ms)" for name in names)
                + f"; ratio {ratios[-1]:.2f}", flush=True)
    finally:
        peaks = {name: server.stop() for name, server in servers.items()}
    s = summarize(ratios)
    print(f"{os.path.basename(ns.gguf)}: one chat stream, conveyor / llama-server, {ns.rounds} paired rounds: median "
          f"{s['median']:.2f}, range {s['low']:.2f}-{s['high']:.2f}; rounds' medians conveyor "
          f"{' / '.join(f'{x:.1f}' for x in rates['conveyor'])}, llama-server "
          f"{' / '.join(f'{x:.1f}' for x in rates['llama-server'])} tok/s; peak RSS GiB "
          + ", ".join(f"{name} {gib:.2f}" for name, gib in peaks.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
