#!/usr/bin/env python3
"""conveyor's one-stream decode over HTTP against llama.cpp's ``llama-bench``, in paired rounds.

    python benchmarks/batch1_paired.py --gguf PATH/model.gguf --llama-bench PATH/llama-bench \
        [--rounds 6] [--streams 3] [--output-tokens 256] [--bench-tokens 128] [--threads 2] [--conveyor-arg=...]

On a shared machine whose speed drifts by 10-25% within minutes, two numbers taken minutes apart (as
``gguf_side_by_side.py`` takes llama-bench's after both servers ran) compare the minutes as much as the engines.
Here conveyor serves the GGUF on 127.0.0.1 for the whole run, idle while llama-bench runs, and each round is
``llama-bench -p 0 -n BENCH_TOKENS -r 1`` (tg128 by default, the issue's measure) then ``--streams`` streaming
requests of ``--output-tokens`` to conveyor, read as
``gguf_side_by_side.py`` reads its batch-1 stream (its ``batch1_decode``: tokens after the first over the time
between first and last, a blocking reader). A round's ratio is the median stream's tok/s over llama-bench's
tg tok/s; the summary is the rounds' median and range. llama-bench has no HTTP, no client and no scheduler in
it: the ratio is what conveyor's serving path keeps of its lead in decode.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import gguf_side_by_side as sbs  # noqa: E402


class Prompt:
    """The batch-1 request (``batch1_decode`` reads ``prompt`` and ``prompt_token_ids``)."""

    prompt = "Once upon a time"
    prompt_token_ids = None


def llama_bench_tg(binary: str, gguf: str, threads: int, tokens: int) -> float:
    """One repetition of ``llama-bench -p 0 -n TOKENS``: its decode tok/s."""
    proc = subprocess.run([binary, "-m", gguf, "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "1",
                           "-o", "json"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return sbs.parse_llama_bench(proc.stdout)[f"tg{tokens}"]


def summarize(rounds: list[tuple[float, list[float]]]) -> dict:
    """(llama-bench tok/s, conveyor's streams' tok/s) per round -> each round's ratio (median stream / llama-bench)
    and their median and range."""
    ratios = [statistics.median(streams) / bench for bench, streams in rounds]
    return dict(ratios=ratios, median=statistics.median(ratios), low=min(ratios), high=max(ratios))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench binary")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--streams", type=int, default=3, help="conveyor streams per round (their median counts)")
    ap.add_argument("--output-tokens", type=int, default=256, help="tokens of each conveyor stream")
    ap.add_argument("--bench-tokens", type=int, default=128, help="llama-bench -n (tg128 by default)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--conveyor-arg", action="append", default=[], metavar="ARG")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ns = ap.parse_args(argv)

    port = sbs.free_port()
    server = sbs.Server("conveyor", sbs.conveyor_cmd(ns.gguf, port, ns.threads, ns.conveyor_arg), port,
                        tempfile.mkdtemp(prefix="batch1-paired-"))
    rounds = []
    try:
        server.wait_ready(ns.ready_timeout)
        sbs.batch1_decode(server.url, Prompt, 16)  # warm-ups, unmeasured: the first request, the first file read
        llama_bench_tg(ns.llama_bench, ns.gguf, ns.threads, ns.bench_tokens)
        for r in range(ns.rounds):
            bench = llama_bench_tg(ns.llama_bench, ns.gguf, ns.threads, ns.bench_tokens)
            runs = [sbs.batch1_decode(server.url, Prompt, ns.output_tokens) for _ in range(ns.streams)]
            if not all(run["ignore_eos_honoured"] for run in runs):
                raise RuntimeError("a stream ended before its max_tokens: ignore_eos not honoured")
            streams = [run["tok_s"] for run in runs]
            rounds.append((bench, streams))
            print(f"round {r + 1}: llama-bench tg{ns.bench_tokens} {bench:.1f} tok/s, conveyor over HTTP "
                  f"{statistics.median(streams):.1f} ({min(streams):.1f}-{max(streams):.1f}), "
                  f"ratio {statistics.median(streams) / bench:.2f}", flush=True)
    finally:
        server.stop()
    s = summarize(rounds)
    print(f"{os.path.basename(ns.gguf)}: conveyor over HTTP / llama-bench, {ns.rounds} paired rounds: median "
          f"{s['median']:.2f}, range {s['low']:.2f}-{s['high']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
