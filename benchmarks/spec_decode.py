#!/usr/bin/env python3
"""Speculative decoding (n-gram prompt lookup, a draft model) against none, on the same engine, model and prompts,
in one run.

    python benchmarks/spec_decode.py [--model PATH] [--quantization none] [--draft-model PATH] [--k 4] \
        [--modes draft-adaptive,draft-k=4] [--skip-longtail] [--online-rate 4] [--num-requests 100] [--rounds 2] \
        [--json out.json]

Modes, each an ``LLM`` of its own on the same model (the default: SmolLM2-135M-Instruct, the wheel's Q4_1):
``none``; ``ngram-adaptive`` (``{"method": "ngram", "num_speculative_tokens": K}``: each step's lengths chosen
from the load); ``ngram-k=K`` (the same with ``"adaptive": false``: always K when the lookup proposes); with
``--draft-model``, ``draft-adaptive`` and ``draft-k=K`` (``{"model": PATH, ...}``), e.g. the float32 model
(``--quantization none``) drafted by its own 4-bit file.

Workloads:

- copy-heavy: chat requests that edit or repeat a passage of code from the Python standard library (the case
  prompt lookup is for), greedy, 256 tokens at most; decoded at batch 1 (one request at a time) and batch 4
  (four at once); output tokens per second of wall time, over all of them (prefill included), and decode tokens
  per second: the tokens produced after every request of a batch had its first one, over that time (the phase
  speculation acts on; the prompts' prefill, the same in every mode, is left out);
- long-tail (the packaged trace, greedy, ``ignore_eos``, first ``--num-requests``): at saturation (every request
  at t=0: output tok/s) and at ``--online-rate`` req/s (Poisson, seed 0; TPOT p50 by the in-process replay,
  ``conveyor.bench.online``). With ``ignore_eos`` a small model's greedy text repeats itself, which prompt lookup
  finds; so the same trace is also run sampled (temperature 1, unseeded), where proposals are mostly wrong and
  every verified token is load that pays nothing back: the case a fixed length loses.

The machine's speed drifts over minutes, so the modes take turns: each round runs each workload on every mode
in turn; a cell is a mode's best round (TPOT: the median over rounds). Every mode's greedy tokens are compared
with ``none``'s, request by request. A mode's speedup is its rate over ``none``'s in the same run.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from conveyor import LLM, SamplingParams  # noqa: E402
from conveyor.bench.metrics import summarize  # noqa: E402
from conveyor.bench.online import replay  # noqa: E402
from conveyor.bench.serve_client import schedule  # noqa: E402
from conveyor.bench.workload import Workload, load_workload  # noqa: E402

LONGTAIL = os.path.join(REPO, "conveyor", "bench", "traces", "longtail_v1.json")
COPY_TASKS = (
    "Repeat this code exactly, with a one-line comment added at the top:",
    "Add type hints to this function. Reply with the whole function:",
    "Rename the first parameter of this function to `source` everywhere and reply with the complete code:",
    "Add a comment above each line of this code that explains it, keeping the code unchanged:",
)


def copy_heavy_messages() -> list[list[dict]]:
    """Eight chat requests: each of ``COPY_TASKS`` on two standard-library functions (their source as shipped
    with this Python, so every machine has the same text)."""
    import shlex
    import textwrap

    sources = [inspect.getsource(textwrap.dedent), inspect.getsource(shlex.join)]
    return [[{"role": "user", "content": f"{task}\n\n```python\n{src}```"}] for src in sources for task in COPY_TASKS]


def make_llm(model: str | None, spec: dict | None, quantization: str = "auto") -> LLM:
    return LLM(model, speculative_config=spec, enable_prefix_caching=False, quantization=quantization)


def counters(llm) -> dict:
    c = llm.engine.scheduler.spec_counters
    return dict(drafts=c.num_drafts, draft_tokens=c.num_draft_tokens, accepted=c.num_accepted_tokens)


def measured(llm, fn) -> dict:
    """``fn()``'s result with the speculation counters it moved."""
    before = counters(llm)
    result = fn()
    return {**result, **{k: v - before[k] for k, v in counters(llm).items()}}


def decode_phase(completions) -> tuple[int, float]:
    """Tokens one batch produced after all its requests had their first token, and the seconds that took."""
    start = max(c.token_times[0] for c in completions)
    end = max(c.token_times[-1] for c in completions)
    return sum(t > start for c in completions for t in c.token_times), end - start


def copy_heavy(llm, batch: int) -> dict:
    """Output tok/s over the copy-heavy requests, ``batch`` at a time (the engine batches what it is given), and
    their decode phases' tok/s; their token ids."""
    greedy = SamplingParams(temperature=0.0, max_tokens=256)
    msgs = copy_heavy_messages()
    tokens, decode_tokens, decode_s, start = [], 0, 0.0, time.perf_counter()
    for i in range(0, len(msgs), batch):
        completions = [o.outputs[0] for o in llm.chat(msgs[i:i + batch], greedy, use_tqdm=False)]
        tokens += [list(c.token_ids) for c in completions]
        n, s = decode_phase(completions)
        decode_tokens, decode_s = decode_tokens + n, decode_s + s
    wall = time.perf_counter() - start
    return dict(tok_s=sum(map(len, tokens)) / wall, wall_s=wall, decode_tok_s=decode_tokens / decode_s,
                tokens=tokens)


def longtail(llm, workload: Workload, rate: float, temperature: float = 0.0) -> dict:
    """The trace through the in-process replay: all at t=0 (output tok/s), then at ``rate`` req/s (TPOT)."""
    if temperature:
        workload = Workload(workload.name, [replace(r, params={**r.params, "temperature": temperature})
                                            for r in workload.requests], workload.seed)
    engine = llm.engine
    burst = replay(engine, Workload(workload.name, [replace(r, arrival_s=0.0) for r in workload.requests]))
    times = schedule(workload, rate, 1.0, 0)
    online = replay(engine, Workload(workload.name, [replace(r, arrival_s=t) for r, t in zip(workload.requests,
                                                                                            times)]))
    b, o = summarize(burst.timings, burst.duration_s), summarize(online.timings, online.duration_s)
    return dict(tok_s=b.output_throughput, burst_s=burst.duration_s, tpot_p50_ms=1e3 * o.tpot.p50,
                tpot_p99_ms=1e3 * o.tpot.p99, ttft_p50_ms=1e3 * o.ttft.p50, online_tok_s=o.output_throughput,
                tokens=[burst.output_token_ids[str(r.id)] for r in workload.requests])


def best_of(rounds: list[dict]) -> dict:
    """The round with the highest rate; TPOT as the median over rounds (each round ran the modes in turn)."""
    best = dict(max(rounds, key=lambda r: r["tok_s"]))
    if "tpot_p50_ms" in best:
        for key in ("tpot_p50_ms", "tpot_p99_ms"):
            best[key] = statistics.median(r[key] for r in rounds)
    if "decode_tok_s" in best:
        best["decode_tok_s"] = max(r["decode_tok_s"] for r in rounds)
    best["rounds_tok_s"] = [r["tok_s"] for r in rounds]
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model conveyor loads (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--quantization", default="auto", help="the target's --quantization (e.g. none: dequantized)")
    ap.add_argument("--draft-model", default=None, help="also run a draft model's modes")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--num-requests", type=int, default=100, help="long-tail requests")
    ap.add_argument("--online-rate", type=float, default=4.0, help="req/s of the long-tail online replay")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each runs every mode in turn, per workload")
    ap.add_argument("--skip-longtail", action="store_true")
    ap.add_argument("--modes", default=None, help="only these modes, comma-separated (none is always run)")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    modes = {"none": None, "ngram-adaptive": {"method": "ngram", "num_speculative_tokens": ns.k},
             f"ngram-k={ns.k}": {"method": "ngram", "num_speculative_tokens": ns.k, "adaptive": False}}
    if ns.draft_model:
        modes |= {"draft-adaptive": {"model": ns.draft_model, "num_speculative_tokens": ns.k},
                  f"draft-k={ns.k}": {"model": ns.draft_model, "num_speculative_tokens": ns.k, "adaptive": False}}
    if ns.modes:
        keep = {"none", *ns.modes.split(",")}
        modes = {name: spec for name, spec in modes.items() if name in keep}
    workload = load_workload(LONGTAIL)
    workload = Workload(workload.name, workload.requests[:ns.num_requests], workload.seed)
    llms = {name: make_llm(ns.model, spec, ns.quantization) for name, spec in modes.items()}
    for llm in llms.values():  # warm-up: kernels, first-step allocations, the cost fit
        llm.chat(copy_heavy_messages()[:4], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    cells = {"copy_b1": lambda llm: copy_heavy(llm, 1), "copy_b4": lambda llm: copy_heavy(llm, 4)}
    if not ns.skip_longtail:
        cells["longtail"] = lambda llm: longtail(llm, workload, ns.online_rate)
        cells["longtail_sampled"] = lambda llm: longtail(llm, workload, ns.online_rate, temperature=1.0)
    runs: dict[str, dict[str, list]] = {name: {cell: [] for cell in cells} for name in modes}
    for r in range(ns.rounds):
        for cell, fn in cells.items():
            for name, llm in llms.items():
                res = runs[name][cell]
                res.append(measured(llm, lambda: fn(llm)))
                decode = f" (decode {res[-1]['decode_tok_s']:.1f})" if "decode_tok_s" in res[-1] else ""
                print(f"[round {r + 1}] {cell} {name}: {res[-1]['tok_s']:.1f} tok/s{decode}", file=sys.stderr,
                      flush=True)
    results = {name: {cell: best_of(rounds) for cell, rounds in cells_.items()} for name, cells_ in runs.items()}
    print(format_table(results, ns))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": vars(ns), "results": results}, f, indent=1)
    return 0


def format_table(results: dict, ns) -> str:
    """One row per mode: copy-heavy rates (end to end, then the decode phase), acceptance, and each long-tail run's
    rate and TPOT; (x) = over none's."""
    base = results["none"]
    longtails = [k for k in ("longtail", "longtail_sampled") if k in base]
    head = ("| mode | copy-heavy b1 tok/s (x) | b4 tok/s (x) | decode phase: b1 tok/s (x) | b4 tok/s (x) |"
            " accepted / proposed (copy-heavy) |")
    for k in longtails:
        head += f" {k.replace('_', ', ')}: t=0 tok/s (x) | at {ns.online_rate:g} req/s TPOT p50 / p99 ms |"
    lines = [head + " greedy tokens = none's |", "|---" * (head.count("|") - 1) + "|---|"]
    for name, row in results.items():
        greedy = [k for k in row if k != "longtail_sampled"]
        same = all(row[k]["tokens"] == base[k]["tokens"] for k in greedy)
        copy = [row[f"copy_b{b}"] for b in (1, 4)]
        cells = [f"{c[key]:.1f} ({c[key] / base[f'copy_b{b}'][key]:.2f})"
                 for key in ("tok_s", "decode_tok_s") for b, c in zip((1, 4), copy)]
        cells.append(f"{sum(c['accepted'] for c in copy)} / {sum(c['draft_tokens'] for c in copy)}")
        for k in longtails:
            lt = row[k]
            cells += [f"{lt['tok_s']:.1f} ({lt['tok_s'] / base[k]['tok_s']:.3f})",
                      f"{lt['tpot_p50_ms']:.1f} / {lt['tpot_p99_ms']:.1f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
