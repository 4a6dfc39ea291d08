"""What KV eviction buys at equal KV memory: a long-context RAG trace through the engine with and without it
(``conveyor bench kv-eviction --trace N``; docs/kv-eviction.md, "What it buys").

Every configuration gets the same KV pool (``--num-kv-blocks``) and the same requests, all queued at once: real
text (slices of the stdlib's documentation, as the quality tables use) of ``--trace-prompt-len`` tokens, each
answered greedily with ``ignore_eos`` for ``--trace-output-len`` tokens, so each configuration does the same
work. An evicting configuration gives every request a budget of a fraction of its prompt's length (the fraction
the quality tables measured), through ``SamplingParams.kv_budget_tokens``. What is reported per configuration:
the requests running per step (mean over time, and peak), throughput, TTFT and ITL, preemptions and the blocks
eviction gave back.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from conveyor.bench.offline import TokenRates
from conveyor.core.sampling_params import SamplingParams


@dataclass
class TraceResult(TokenRates):
    label: str
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    mean_running: float  # requests in the running batch, averaged over the run's wall time
    peak_running: int
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    preemptions: int
    evicted_blocks: int


def rag_cases(text_ids: list[int], num: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
              seed: int = 0) -> list[tuple[list[int], int]]:
    """``num`` (prompt ids, output length) pairs: prompts are slices of ``text_ids`` at random offsets, lengths
    uniform in the given bounds."""
    rng = random.Random(seed)
    cases = []
    for _ in range(num):
        n = rng.randint(*prompt_len)
        if n > len(text_ids):
            raise ValueError(f"the text has {len(text_ids)} tokens, fewer than a {n}-token prompt")
        start = rng.randrange(0, len(text_ids) - n + 1)
        cases.append((text_ids[start:start + n], rng.randint(*output_len)))
    return cases


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_trace(engine, cases: list[tuple[list[int], int]], budget_fraction: float | None, label: str) -> TraceResult:
    """Queue every case at once on ``engine`` (an ``LLMEngine``), step until all finish, and measure."""
    running: list[tuple[float, int]] = []  # (step duration, requests running in it)
    engine.step_listeners.append(lambda rec: running.append((rec.duration, rec.num_running)))
    evicted_before = engine.kv_manager.num_evicted_blocks
    start = time.monotonic()
    ids = []
    for prompt, out_len in cases:
        budget = None if budget_fraction is None else max(1, int(budget_fraction * len(prompt)))
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, kv_budget_tokens=budget)
        ids.append(engine.add_request(None, {"prompt_token_ids": prompt}, params))
    done = {}
    try:
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        engine.step_listeners.pop()
    wall = time.monotonic() - start
    outs = [done[i] for i in ids]
    ttft = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    itl = [b - a for o in outs for a, b in zip(o.outputs[0].token_times, o.outputs[0].token_times[1:])]
    busy = sum(d for d, _ in running)
    return TraceResult(
        label=label, wall_s=wall,
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
        prompt_tokens=sum(len(p) for p, _ in cases),
        mean_running=sum(d * n for d, n in running) / busy if busy else 0.0,
        peak_running=max((n for _, n in running), default=0),
        ttft_p50=_pct(ttft, 0.5), ttft_p99=_pct(ttft, 0.99),
        itl_p50=1000 * _pct(itl, 0.5), itl_p99=1000 * _pct(itl, 0.99),
        preemptions=sum(o.metrics.num_preemptions for o in outs),
        evicted_blocks=engine.kv_manager.num_evicted_blocks - evicted_before)


def print_header() -> None:
    print("| configuration | wall s | output tok/s | vs exact | running, mean / peak | vs exact | TTFT p50 / p99 s "
          "| ITL p50 / p99 ms | preemptions | evicted blocks |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)


def print_row(r: TraceResult, base: TraceResult) -> None:
    """One configuration's row, its ratios against ``base`` (the exact cache's run)."""
    print(f"| {r.label} | {r.wall_s:.1f} | {r.output_tok_s:.1f} | {r.output_tok_s / base.output_tok_s:.2f}x | "
          f"{r.mean_running:.1f} / {r.peak_running} | {r.mean_running / base.mean_running:.2f}x | "
          f"{r.ttft_p50:.1f} / {r.ttft_p99:.1f} | {r.itl_p50:.1f} / {r.itl_p99:.1f} | {r.preemptions} | "
          f"{r.evicted_blocks} |", flush=True)
