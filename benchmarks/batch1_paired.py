#!/usr/bin/env python3
"""conveyor's one-stream decode against llama.cpp's ``llama-bench``, in paired rounds, over HTTP or offline.

    python benchmarks/batch1_paired.py --gguf PATH/model.gguf --llama-bench PATH/llama-bench \
        [--engine http|offline] [--rounds 6] [--streams 3] [--output-tokens 256] [--bench-tokens 128] \
        [--threads 2] [--conveyor-arg=...]

On a shared machine whose speed drifts by 10-25% within minutes, two numbers taken minutes apart (as
``gguf_side_by_side.py`` takes llama-bench's after both servers ran) compare the minutes as much as the engines.
Here conveyor serves the GGUF on 127.0.0.1 for the whole run, idle while llama-bench runs, and each round is
``llama-bench -p 0 -n BENCH_TOKENS -r 1`` (tg128 by default, the issue's measure) then ``--streams`` streaming
requests of ``--output-tokens`` to conveyor: the request and the reader of ``gguf_side_by_side.py``'s batch-1
phase (the trace's first prompt; ``batch1_decode``: tokens after the first over the time between first and last).
A round's ratio is the median stream's tok/s over llama-bench's; the summary is the rounds' median and range.
llama-bench has no HTTP, no client and no scheduler in it: the ratio is what conveyor's serving path keeps of its
lead in decode.

``--engine offline`` pairs like with like: llama-bench is a library call timed in-process, so conveyor's side is
the offline engine (``LLMEngine``, as ``LLM`` runs it) in this process, one request of ``--output-tokens`` with
``ignore_eos`` after the same prompt, decode tok/s by the same rule (tokens after the first over first token to
last, each token's time taken when the engine step that made it returns). It keeps the scheduler, the runner,
sampling and detokenization; it leaves out HTTP, the API process and the client (``--engine http`` has them).
The engine stays loaded and idle while llama-bench runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

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


class OfflineStream:
    """conveyor's offline engine on the GGUF, loaded once; ``decode`` runs one request alone and times it."""

    def __init__(self, gguf: str, threads: int, max_model_len: int, **extra) -> None:
        from conveyor.engine.args import EngineArgs
        from conveyor.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(EngineArgs(model=gguf, num_threads=threads, enable_prefix_caching=False, **extra,
                                           max_model_len=max_model_len))

    def decode(self, req, output_tokens: int) -> dict:
        """One greedy ``ignore_eos`` request of ``output_tokens`` alone; decode tok/s = (tokens - 1) / (last
        token's time - first token's time), as ``batch1_decode`` reads a stream."""
        from conveyor.core.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
        prompt = ({"prompt_token_ids": list(req.prompt_token_ids)} if req.prompt_token_ids is not None
                  else req.prompt)
        engine = self.engine
        engine.add_request(None, prompt, params)
        times: list[float] = []
        seen, finished = 0, False
        while not finished:
            for out in engine.step():
                count = len(out.outputs[0].token_ids)
                now = time.perf_counter()
                times.extend([now] * (count - seen))  # a step that made k tokens: k arrivals at its end
                seen, finished = count, out.finished
        tokens = len(times)
        span = times[-1] - times[0]
        return dict(tokens=tokens, tok_s=(tokens - 1) / span if span > 0 else float("nan"),
                    ignore_eos_honoured=tokens == output_tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench binary")
    ap.add_argument("--engine", choices=("http", "offline"), default="http",
                    help="conveyor's side: a stream from `conveyor serve` (http) or the offline engine in-process")
    ap.add_argument("--max-model-len", type=int, default=4096, help="offline engine's context (--engine offline)")
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

    if ns.engine == "offline":
        stream = OfflineStream(ns.gguf, ns.threads, ns.max_model_len)
        decode, stop, label = (lambda n: stream.decode(prompt, n)), (lambda: None), "offline"
    else:
        port = sbs.free_port()
        server = sbs.Server("conveyor", sbs.conveyor_cmd(ns.gguf, port, ns.threads, ns.conveyor_arg), port,
                            tempfile.mkdtemp(prefix="batch1-paired-"))
        decode, stop, label = (lambda n: sbs.batch1_decode(server.url, prompt, n)), server.stop, "over HTTP"
    ratios = []
    try:
        if ns.engine == "http":
            server.wait_ready(ns.ready_timeout)
        decode(16)  # warm-ups, unmeasured: the first request, the first file read
        bench_tg()
        for r in range(ns.rounds):
            bench = bench_tg()
            runs = [decode(ns.output_tokens) for _ in range(ns.streams)]
            if not all(run["ignore_eos_honoured"] for run in runs):
                raise RuntimeError("a stream ended before its max_tokens: ignore_eos not honoured")
            streams = [run["tok_s"] for run in runs]
            ratios.append(round_ratio(bench, streams))
            print(f"round {r + 1}: llama-bench tg{ns.bench_tokens} {bench:.1f} tok/s, conveyor {label} "
                  f"{statistics.median(streams):.1f} ({min(streams):.1f}-{max(streams):.1f}), "
                  f"ratio {ratios[-1]:.2f}", flush=True)
    finally:
        stop()
    s = summarize(ratios)
    print(f"{os.path.basename(ns.gguf)}: conveyor {label} / llama-bench, {ns.rounds} paired rounds: median "
          f"{s['median']:.2f}, range {s['low']:.2f}-{s['high']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
