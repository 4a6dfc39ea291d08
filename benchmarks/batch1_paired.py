#!/usr/bin/env python3
"""conveyor's one-stream decode over HTTP against llama.cpp's ``llama-bench``, in paired rounds.

    python benchmarks/batch1_paired.py --gguf PATH/model.gguf --llama-bench PATH/llama-bench \
        [--rounds 6] [--streams 3] [--output-tokens 256] [--bench-tokens 128] [--threads 2] [--conveyor-arg=...]

On a shared machine whose speed drifts by 10-25% within minutes, two numbers taken minutes apart (as
``gguf_side_by_side.py`` takes llama-bench's after both servers ran) compare the minutes as much as the engines.
Here conveyor serves the GGUF on 127.0.0.1 for the whole run, idle while llama-bench runs, and each round is
``llama-bench -p 0 -n BENCH_TOKENS -r 1`` (tg128 by default, the issue's measure) then ``--streams`` streaming
requests of ``--output-tokens`` to conveyor: the request and the reader of ``gguf_side_by_side.py``'s batch-1
phase (the trace's first prompt; ``batch1_decode``: tokens after the first over the time between first and last).
A round's ratio is the median stream's tok/s over llama-bench's; the summary is the rounds' median and range.
llama-bench has no HTTP, no client and no scheduler in it: the ratio is what conveyor's serving path keeps of its
lead in decode.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import gguf_side_by_side as sbs  # noqa: E402
from conveyor.bench.workload import load_workload  # noqa: E402


def round_ratio(bench: float, streams: list[float]) -> float:
    """A round's ratio: conveyor's median stream over llama-bench's tok/s."""
    return statistics.median(streams) / bench


def summarize(ratios: list[float]) -> dict:
    """The rounds' ratios, their median and range."""
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
    ap.add_argument("--trace", default=sbs.DEFAULT_TRACE, help="the trace whose first prompt the streams send")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ns = ap.parse_args(argv)

    def bench_tg() -> float:
        return sbs.run_llama_bench(ns.llama_bench, ns.gguf, ns.threads, ns.bench_tokens, 1)[f"tg{ns.bench_tokens}"]

    prompt = sbs.batch1_prompt(load_workload(ns.trace))

    port = sbs.free_port()
    server = sbs.Server("conveyor", sbs.conveyor_cmd(ns.gguf, port, ns.threads, ns.conveyor_arg), port,
                        tempfile.mkdtemp(prefix="batch1-paired-"))
    ratios = []
    try:
        server.wait_ready(ns.ready_timeout)
        sbs.batch1_decode(server.url, prompt, 16)  # warm-ups, unmeasured: the first request, the first file read
        bench_tg()
        for r in range(ns.rounds):
            bench = bench_tg()
            runs = [sbs.batch1_decode(server.url, prompt, ns.output_tokens) for _ in range(ns.streams)]
            if not all(run["ignore_eos_honoured"] for run in runs):
                raise RuntimeError("a stream ended before its max_tokens: ignore_eos not honoured")
            streams = [run["tok_s"] for run in runs]
            ratios.append(round_ratio(bench, streams))
            print(f"round {r + 1}: llama-bench tg{ns.bench_tokens} {bench:.1f} tok/s, conveyor over HTTP "
                  f"{statistics.median(streams):.1f} ({min(streams):.1f}-{max(streams):.1f}), "
                  f"ratio {ratios[-1]:.2f}", flush=True)
    finally:
        server.stop()
    s = summarize(ratios)
    print(f"{os.path.basename(ns.gguf)}: conveyor over HTTP / llama-bench, {ns.rounds} paired rounds: median "
          f"{s['median']:.2f}, range {s['low']:.2f}-{s['high']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
