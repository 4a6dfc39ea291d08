"""The comparison's table (terminal and markdown) and report.md, from the results document of ``compare.py``."""

from __future__ import annotations

from pathlib import Path

from conveyor.bench.prefix_savings import format_top_prefixes

COLUMNS = [  # header, how to get it from one run, format
    ("config", lambda r: r["label"], "{}"),
    ("wall s", lambda r: r["summary"]["duration_s"], "{:.1f}"),
    ("req/s", lambda r: r["summary"]["request_throughput"], "{:.2f}"),
    ("out tok/s", lambda r: r["summary"]["output_throughput"], "{:.0f}"),
    ("TTFT p50 ms", lambda r: r["summary"]["ttft"]["p50"] * 1e3, "{:.0f}"),
    ("TTFT p99 ms", lambda r: r["summary"]["ttft"]["p99"] * 1e3, "{:.0f}"),
    ("ITL p50 ms", lambda r: r["summary"]["itl"]["p50"] * 1e3, "{:.1f}"),
    ("ITL p99 ms", lambda r: r["summary"]["itl"]["p99"] * 1e3, "{:.1f}"),
    ("E2E p50 s", lambda r: r["summary"]["e2e"]["p50"], "{:.2f}"),
    ("E2E p99 s", lambda r: r["summary"]["e2e"]["p99"], "{:.2f}"),
    ("wasted tok", lambda r: r["engine"]["wasted_fraction"], "{:.0%}"),
    ("KV waste", lambda r: r["engine"]["kv_waste"], "{:.0%}"),
    ("peak conc", lambda r: r["engine"]["peak_concurrency"], "{}"),
    ("batch", lambda r: r["engine"]["mean_batch_size"], "{:.1f}"),
    ("preempt", lambda r: r["engine"]["preemptions"], "{}"),
    ("% matmul", lambda r: r["engine"]["matmul_fraction"] or 0.0, "{:.0%}"),
    # what the prefix cache saved (prefix_savings); absent in results written before it existed
    ("hit rate", lambda r: r.get("prefix", {}).get("hit_rate", 0.0), "{:.0%}"),
    ("saved tok", lambda r: r.get("prefix", {}).get("saved_tokens", 0), "{}"),
    ("saved PFLOP", lambda r: r.get("prefix", {}).get("saved_flops", 0.0) / 1e15, "{:.3g}"),
    ("saved s", lambda r: r.get("prefix", {}).get("saved_seconds", 0.0), "{:.2f}"),
]


def table_rows(results: dict) -> list[list[str]]:
    return [[fmt.format(get(run)) for _, get, fmt in COLUMNS] for run in results["runs"]]


def format_table(results: dict) -> str:
    """A fixed-width table, one row per configuration."""
    header = [h for h, _, _ in COLUMNS]
    rows = table_rows(results)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    for row in rows:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def markdown_table(results: dict) -> str:
    header = [h for h, _, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    return "\n".join(lines)


def prefix_section(results: dict) -> list[str]:
    """The prefix cache's savings per run, and each run's top prefixes by prompt tokens with their hit rates."""
    runs = [r for r in results["runs"] if r.get("prefix", {}).get("admitted_tokens")]
    if not runs:
        return []
    lines = ["## prefix cache", "",
             "*hit rate* = prompt tokens served from the cache / tokens of the requests admitted; *saved s* = each "
             "step's saved tokens at that step's measured rate (duration / tokens computed; overstates where small "
             "steps are bound by weight streaming), and at the run's fastest step's rate (a lower bound); *saved PFLOP* = the "
             "skipped forward passes (linear layers + causal attention over the hit). Lookup counters are vLLM's "
             "prefix_cache_queries / hits (per lookup: an admission that found no room looks again).", "",
             "| config | hit rate | saved tokens | saved PFLOP | saved s (step rate) | saved s (peak rate) | busy s | "
             "evictions | lookup hit rate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        p = r["prefix"]
        q, h = p.get("lookup_queries"), p.get("lookup_hits")
        lookup = f"{h / q:.1%}" if q else "-"
        lines.append(f"| {r['label']} | {p['hit_rate']:.1%} | {p['saved_tokens']} | {p['saved_flops'] / 1e15:.3g} | "
                     f"{p['saved_seconds']:.2f} | {p.get('saved_seconds_at_peak', 0.0):.2f} | {p['busy_s']:.2f} | "
                     f"{p.get('evictions')} | {lookup} |")
    for r in runs:
        if r["prefix"].get("top_prefixes"):
            lines += ["", f"Top prefixes, {r['label']} (first-block key, hit rate at first admission):", ""]
            lines += format_top_prefixes(r["prefix"]["top_prefixes"])
    return lines + [""]


def write_report(results: dict, out: Path, plots: list[Path]) -> Path:
    """report.md: what ran, the table, the definitions, and every plot."""
    m = results["machine"]
    mode = "all requests at t=0 (offline)" if results["offline"] else "replayed at their arrival times"
    a = results["base_args"]
    sim = results.get("simulated")
    if sim:
        where = (f"SIMULATED ({sim['cost_model']}; {sim['target']}): peaks {m['matmul_gflops'] / 1e3:.0f} TFLOP/s, "
                 f"{m['mem_bandwidth_gbs']:.0f} GB/s over all devices; *% matmul* is MFU against them.")
    else:
        where = (f"model {results['model']} ({a['dtype']}, {a['device']}); machine as measured in this run: "
                 f"{m['matmul_gflops']:.0f} GFLOP/s fp32 matmul, {m['mem_bandwidth_gbs']:.1f} GB/s copy.")
    lines = [
        f"# conveyor bench compare: {results['workload']}", "",
        f"{results['num_requests']} requests ({results['prompt_tokens']} prompt + {results['output_tokens']} output "
        f"tokens), {mode}; {where}", "",
        markdown_table(results), "",
        "Definitions (vLLM's serving benchmark): TTFT = first token - arrival; ITL = every gap between consecutive "
        "tokens; E2E = finish - arrival; throughput over the run's wall time. *wasted tok* = (padding + idle-slot "
        "tokens) / all computed tokens; *KV waste* = 1 - tokens stored / token slots reserved (time-averaged); "
        "*peak conc* = most requests holding a slot; *batch* = mean requests per step; *% matmul* = model FLOPs / "
        "wall / measured square-GEMM rate. Static and dynamic report a request finished when its own output "
        "completes; its slot stays busy (and is counted as waste) until the batch drains.", "",
    ]
    lines += prefix_section(results)
    for path in plots:
        lines += [f"## {path.stem.replace('_', ' ')}", "", f"![{path.stem}]({path.name})", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report
