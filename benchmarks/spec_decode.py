#!/usr/bin/env python3
"""Speculative decoding (n-gram prompt lookup) against none, on the same engine, model and prompts, in one run.

    python benchmarks/spec_decode.py [--model PATH] [--k 4] [--online-rate 4] [--num-requests 100] [--json out.json]

Modes, each a fresh ``LLM`` on the same model (the default: SmolLM2-135M-Instruct, the wheel's Q4_1):
``none``; ``ngram-adaptive`` (``{"method": "ngram", "num_speculative_tokens": K}``: each step's lengths chosen
from the load); ``ngram-k=K`` (the same with ``"adaptive": false``: always K when the lookup proposes).

Workloads:

- copy-heavy: chat requests that edit or repeat a passage of code from the Python standard library (the case
  prompt lookup is for), greedy, 256 tokens at most; decoded at batch 1 (one request at a time) and batch 4
  (four at once, ``max_num_seqs=4``); output tokens per second of wall time, over all of them;
- long-tail (the packaged trace, greedy, ``ignore_eos``, first ``--num-requests``): at saturation (every request
  at t=0: output tok/s) and at ``--online-rate`` req/s (Poisson, seed 0; TPOT p50 by the in-process replay,
  ``conveyor.bench.online``), where speculation has the least to gain.

Every mode's greedy tokens are compared with ``none``'s, request by request; a mismatch is printed. A mode's
speedup is its rate over ``none``'s in the same run.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
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


def make_llm(model: str | None, spec: dict | None, **kw) -> LLM:
    return LLM(model, speculative_config=spec, enable_prefix_caching=False, **kw)


def copy_heavy(model, spec, batch: int) -> dict:
    """Output tok/s over the copy-heavy requests, ``batch`` at a time; their token ids."""
    llm = make_llm(model, spec, max_num_seqs=batch)
    greedy = SamplingParams(temperature=0.0, max_tokens=256)
    msgs = copy_heavy_messages()
    llm.chat(msgs[:batch], greedy, use_tqdm=False)  # warm-up (kernels, first-step allocations)
    tokens, start = [], time.perf_counter()
    for i in range(0, len(msgs), batch):
        tokens += [list(o.outputs[0].token_ids) for o in llm.chat(msgs[i:i + batch], greedy, use_tqdm=False)]
    wall = time.perf_counter() - start
    return dict(tok_s=sum(map(len, tokens)) / wall, wall_s=wall, tokens=tokens, **counters(llm))


def counters(llm) -> dict:
    c = llm.engine.scheduler.spec_counters
    return dict(drafts=c.num_drafts, draft_tokens=c.num_draft_tokens, accepted=c.num_accepted_tokens)


def longtail(model, spec, workload: Workload, rate: float) -> dict:
    """The trace through the in-process replay: all at t=0 (output tok/s), then at ``rate`` req/s (TPOT)."""
    llm = make_llm(model, spec)
    engine = llm.engine
    warm = Workload(workload.name, workload.requests[:4], workload.seed)
    replay(engine, warm)
    burst = replay(engine, Workload(workload.name, [replace(r, arrival_s=0.0) for r in workload.requests]))
    times = schedule(workload, rate, 1.0, 0)
    online = replay(engine, Workload(workload.name, [replace(r, arrival_s=t) for r, t in zip(workload.requests,
                                                                                            times)]))
    b, o = summarize(burst.timings, burst.duration_s), summarize(online.timings, online.duration_s)
    return dict(burst_tok_s=b.output_throughput, burst_s=burst.duration_s, tpot_p50_ms=1e3 * o.tpot.p50,
                tpot_p99_ms=1e3 * o.tpot.p99, ttft_p50_ms=1e3 * o.ttft.p50, online_tok_s=o.output_throughput,
                tokens=[burst.output_token_ids[str(r.id)] for r in workload.requests], **counters(llm))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model conveyor loads (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--num-requests", type=int, default=100, help="long-tail requests")
    ap.add_argument("--online-rate", type=float, default=4.0, help="req/s of the long-tail online replay")
    ap.add_argument("--skip-longtail", action="store_true")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    modes = {"none": None, "ngram-adaptive": {"method": "ngram", "num_speculative_tokens": ns.k},
             f"ngram-k={ns.k}": {"method": "ngram", "num_speculative_tokens": ns.k, "adaptive": False}}
    workload = load_workload(LONGTAIL)
    workload = Workload(workload.name, workload.requests[:ns.num_requests], workload.seed)
    results: dict[str, dict] = {}
    for name, spec in modes.items():
        row = results[name] = {}
        for batch in (1, 4):
            row[f"copy_b{batch}"] = copy_heavy(ns.model, spec, batch)
            print(f"[{name}] copy-heavy batch {batch}: {row[f'copy_b{batch}']['tok_s']:.1f} tok/s", file=sys.stderr,
                  flush=True)
        if not ns.skip_longtail:
            row["longtail"] = longtail(ns.model, spec, workload, ns.online_rate)
            print(f"[{name}] long-tail: {row['longtail']['burst_tok_s']:.1f} tok/s at t=0, TPOT p50 "
                  f"{row['longtail']['tpot_p50_ms']:.1f} ms at {ns.online_rate:g} req/s", file=sys.stderr, flush=True)
    print(format_table(results, ns))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": vars(ns), "results": results}, f, indent=1)
    return 0


def format_table(results: dict, ns) -> str:
    base = results["none"]
    lines = ["| mode | copy-heavy b1 tok/s (x) | b4 tok/s (x) | accepted / proposed | long-tail t=0 tok/s (x) "
             f"| at {ns.online_rate:g} req/s TPOT p50 / p99 ms | greedy tokens = none's |", "|---|---|---|---|---|---|---|"]
    for name, row in results.items():
        same = all(row[k]["tokens"] == base[k]["tokens"] for k in row)
        drafted = sum(row[k]["draft_tokens"] for k in row)
        accepted = sum(row[k]["accepted"] for k in row)
        cells = [f"{row[f'copy_b{b}']['tok_s']:.1f} ({row[f'copy_b{b}']['tok_s'] / base[f'copy_b{b}']['tok_s']:.2f})"
                 for b in (1, 4)]
        lt = row.get("longtail")
        lt_cells = ["—", "—"] if lt is None else [
            f"{lt['burst_tok_s']:.1f} ({lt['burst_tok_s'] / base['longtail']['burst_tok_s']:.3f})",
            f"{lt['tpot_p50_ms']:.1f} / {lt['tpot_p99_ms']:.1f}"]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {accepted} / {drafted} | {lt_cells[0]} | {lt_cells[1]} "
                     f"| {'yes' if same else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
