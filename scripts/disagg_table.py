"""The numbers behind the disaggregation table (README, docs/simulator.md): colocated chunked prefill against
prefill/decode splits at equal GPU count, on the simulator (``bench compare --simulate --disaggregate``).

Llama-3-70B on 8x H100-SXM and Llama-3-8B on 2x H100-SXM; long-tail traffic (``bench workload longtail``, 1,000
requests, seed 7) and a prefill-heavy trace (``bench workload rag``, 300 requests of 2k-7k-token prompts, seed 7);
each over a range of request rates; plus slow-link rows for 1P1D. Every run is a ``conveyor bench compare``
command, printed before it runs; its results.json and report.md land in ``--out/<name>``. Goodput is DistServe's:
requests per second meeting both the TTFT and the TPOT SLO, at two SLO pairs per workload (below), computed
from each run's timings with ``bench.metrics.summarize``; in brackets, the share of all requests meeting them.

    .venv/bin/python scripts/disagg_table.py --out out/disagg        # about 5 minutes of CPU
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from conveyor.bench.metrics import RequestTiming, summarize
from conveyor.cli import main as conveyor

# name -> model, default TP, layouts at equal GPU count
SETUPS = {
    "70b-8xh100": ("llama-3-70b", 4, "2C@4,1C@8,1P1D@4,2P1D@2/4"),
    "8b-2xh100": ("llama-3-8b", 1, "2C@1,1C@2,1P1D@1"),
}
# workload -> generator flags, SLO pairs (ms) per setup, rates per setup (req/s). The first SLO pair is lax on
# TPOT (50 ms: faster than anyone reads); the second asks for what a decode-only instance holds with headroom
# (70B on TP4: ~18-20 ms a step at these batches -> 25 ms; 8B on one GPU: ~9-10 ms -> 12 ms).
WORKLOADS = {
    "longtail": (["longtail", "--num-requests", "1000", "--seed", "7"],
                 {"70b-8xh100": ("ttft=500,tpot=50", "ttft=500,tpot=25"),
                  "8b-2xh100": ("ttft=500,tpot=50", "ttft=500,tpot=12")},
                 {"70b-8xh100": "16,32,64,96", "8b-2xh100": "32,64,128,192"}),
    "rag": (["rag", "--num-requests", "300", "--seed", "7"],
            {"70b-8xh100": ("ttft=2000,tpot=50", "ttft=2000,tpot=25"),
             "8b-2xh100": ("ttft=2000,tpot=50", "ttft=2000,tpot=12")},
            {"70b-8xh100": "1,2,3,4,5", "8b-2xh100": "4,8,12,16,20"}),
}
# the README's short table: (setup, workload, rate) rows, one column per layout position in SETUPS
SUMMARY_ROWS = [("70b-8xh100", "longtail", 64), ("70b-8xh100", "longtail", 96), ("70b-8xh100", "rag", 2),
                ("70b-8xh100", "rag", 4), ("8b-2xh100", "longtail", 128), ("8b-2xh100", "rag", 8),
                ("8b-2xh100", "rag", 12)]
LINK_SUMMARY = {("rag", 2), ("longtail", 64)}  # the link rows of the README's table
PREFILL_BUDGET = "8192"  # a prefill instance has no decodes to protect: whole prompts per step
# slow-link rows: setup, workload, rates, links
LINK_ROWS = [("70b-8xh100", "rag", "2,3", ("nvlink", "rdma-400g", "ethernet-25g")),
             ("70b-8xh100", "longtail", "32,64", ("nvlink", "rdma-400g", "ethernet-25g"))]


def cli(argv: list[str]) -> None:
    print("$ conveyor " + shlex.join(argv), flush=True)
    conveyor(argv)


REUSE = False  # --reuse: read results.json of a previous run instead of running its command again


def compare(out: Path, name: str, setup: str, workload: Path, slo: str, rates: str, layouts: str,
            link: str = "nvlink") -> dict:
    model, tp, _ = SETUPS[setup]
    target = out / name
    if REUSE and (target / "results.json").is_file():
        return json.loads((target / "results.json").read_text())
    cli(["bench", "compare", "--workload", str(workload), "--simulate", "h100-sxm", "--model", model,
         "--tensor-parallel-size", str(tp), "--policies", "chunked", "--disaggregate", layouts,
         "--prefill-max-num-batched-tokens", PREFILL_BUDGET, "--kv-link", link, "--request-rate", rates,
         "--slo", slo, "--no-plots", "--out", str(target)])
    return json.loads((target / "results.json").read_text())


def goodput(run: dict, slo: str) -> tuple[float, float]:
    """(req/s meeting every SLO over the run's duration, share of the requests meeting them), from its timings."""
    slo_ms = {k: float(v) for k, v in (kv.split("=") for kv in slo.split(","))}
    timings = [RequestTiming(**t) for t in run["timings"]]
    s = summarize(timings, run["summary"]["duration_s"], slo_ms)
    return s.goodput, s.goodput * s.duration_s / len(timings)


def rows(results: dict, slos: tuple[str, str], link_column: bool = False) -> list[str]:
    """One markdown row per run: rate, layout, goodput at both SLOs, p99s. Bold: the largest share of requests
    within SLO at that rate, where the layouts differ (goodput per second also moves with when the last request
    ends, so shares are what is compared)."""
    runs = sorted(results["runs"], key=lambda r: r["request_rate"])
    good = {id(r): [goodput(r, slo) for slo in slos] for r in runs}
    shares: dict[tuple[float, int], list[str]] = {}
    for r in runs:
        for i in range(2):
            shares.setdefault((r["request_rate"], i), []).append(f"{good[id(r)][i][1]:.0%}")
    out = []
    for r in runs:
        s, c = r["summary"], r["cluster"]
        cells = []
        for i, (g, share) in enumerate(good[id(r)]):
            cell, at_rate = f"{g:.2f} ({share:.0%})", shares[(r["request_rate"], i)]
            top = max(at_rate, key=lambda v: int(v[:-1]))
            cells.append(f"**{cell}**" if f"{share:.0%}" == top and len(set(at_rate)) > 1 else cell)
        link = f" {c['link']['name']} |" if link_column else ""
        transfer = f"{c['transfer_s']['p99'] * 1e3:.1f}" if c["num_transfers"] else "-"
        out.append(f"| {r['request_rate']:g} | {c['layout']} |{link} {cells[0]} | {cells[1]} | "
                   f"{s['ttft']['p99'] * 1e3:.0f} | {s['itl']['p99'] * 1e3:.1f} | {s['tpot']['p99'] * 1e3:.1f} | "
                   f"{transfer} |")
    return out


def header(slos: tuple[str, str], link_column: bool = False) -> list[str]:
    cols = ["rate (req/s)", "layout", *(["link"] if link_column else []), f"goodput {slos[0]}",
            f"goodput {slos[1]}", "TTFT p99 ms", "ITL p99 ms", "TPOT p99 ms", "KV transfer p99 ms"]
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def summary(all_results: dict, link_rows: list[str]) -> list[str]:
    """The README's table: per row, each layout's share within the lax / tight SLO, TTFT p99, ITL p99."""
    lines = ["| model, traffic (SLOs: TTFT; TPOT lax / tight) | req/s | 2 colocated (2C@4 / 2C@1) | "
             "1 colocated (1C@8 / 1C@2) | 1P1D (@4 / @1) | 2P1D@2/4 |", "|" + "---|" * 6]
    for setup, name, rate in SUMMARY_ROWS:
        slos = WORKLOADS[name][1][setup]
        cells = []
        for r in (r for r in all_results[(setup, name)]["runs"] if r["request_rate"] == rate):
            s = r["summary"]
            shares = [goodput(r, slo)[1] for slo in slos]
            cells.append(f"{shares[0]:.0%} / {shares[1]:.0%}; {s['ttft']['p99'] * 1e3:,.0f}; "
                         f"{s['itl']['p99'] * 1e3:.0f}")
        cells += ["-"] * (4 - len(cells))
        ttft, lax, tight = (slos[0].split(",")[0].split("=")[1], slos[0].split("=")[-1], slos[1].split("=")[-1])
        lines.append(f"| {SETUPS[setup][0]} on {setup.split('-')[1]}, {name} ({ttft}; {lax} / {tight} ms) | "
                     f"{rate} | " + " | ".join(cells) + " |")
    return lines + ["", "1P1D@4 over each link (70B on 8x H100):", "",
                     "| traffic | req/s | KV link | within SLO lax / tight | KV transfer p99 ms | TPOT p99 ms |",
                     "|" + "---|" * 6, *link_rows]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/disagg")
    p.add_argument("--reuse", action="store_true", help="tables from the results.json files already in --out")
    ns = p.parse_args()
    global REUSE
    REUSE = ns.reuse
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    traces = {}
    for name, (gen, _, _) in WORKLOADS.items():
        traces[name] = out / f"{name}.json"
        if not (REUSE and traces[name].is_file()):
            cli(["bench", "workload", *gen, "--out", str(traces[name])])
    lines, all_results, link_rows = [], {}, []
    for setup, (model, _, layouts) in SETUPS.items():
        for name, (_, slos, rates) in WORKLOADS.items():
            res = compare(out, f"{setup}-{name}", setup, traces[name], slos[setup][0], rates[setup], layouts)
            all_results[(setup, name)] = res
            lines += ["", f"{model}, {setup}, {name}, KV link nvlink:", "", *header(slos[setup])]
            lines += rows(res, slos[setup])
    for setup, name, rates, links in LINK_ROWS:
        slos = WORKLOADS[name][1][setup]
        results = [compare(out, f"{setup}-{name}-{link}", setup, traces[name], slos[0], rates, "1P1D@4", link)
                   for link in links]
        merged = {"runs": [r for res in results for r in res["runs"]]}
        lines += ["", f"{SETUPS[setup][0]}, {setup}, {name}, 1P1D@4 over each link:", "",
                  *header(slos, link_column=True)]
        lines += rows(merged, slos, link_column=True)
        for r in (r for r in merged["runs"] if (name, r["request_rate"]) in LINK_SUMMARY):
            shares = [goodput(r, slo)[1] for slo in slos]
            link_rows.append(f"| {SETUPS[setup][0]}, {name} | {r['request_rate']:g} | {r['cluster']['link']['name']} | "
                             f"{shares[0]:.0%} / {shares[1]:.0%} | {r['cluster']['transfer_s']['p99'] * 1e3:,.1f} | "
                             f"{r['summary']['tpot']['p99'] * 1e3:,.1f} |")
    text = "\n".join(["Summary (share of requests within the lax / tight SLO; TTFT p99 ms; ITL p99 ms):", "",
                      *summary(all_results, link_rows), *lines])
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
