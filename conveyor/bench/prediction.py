"""``conveyor sim errors REAL SIMULATED``: how far a simulated comparison is from the real one, config by config.

Both arguments are results.json files of ``bench compare`` (one real, one ``--simulate``) over the same
workload and configurations. The error of a metric is (simulated - real) / real.
"""

from __future__ import annotations

import json
from pathlib import Path

METRICS = {  # name -> how to read it from a run
    "out tok/s": lambda r: r["summary"]["output_throughput"],
    "TTFT p50": lambda r: r["summary"]["ttft"]["p50"],
    "ITL p50": lambda r: r["summary"]["itl"]["p50"],
    "TTFT p99": lambda r: r["summary"]["ttft"]["p99"],
    "ITL p99": lambda r: r["summary"]["itl"]["p99"],
    "E2E p50": lambda r: r["summary"]["e2e"]["p50"],
}


def prediction_errors(real: dict, simulated: dict) -> list[dict]:
    """Per configuration: each metric's real and simulated value and the relative error."""
    sim_runs = {r["label"]: r for r in simulated["runs"]}
    rows = []
    for run in real["runs"]:
        sim = sim_runs.get(run["label"])
        if sim is None:
            raise ValueError(f"configuration {run['label']!r} is in the real results but was not simulated")
        row = {"label": run["label"]}
        for name, get in METRICS.items():
            r, s = get(run), get(sim)
            row[name] = (r, s, (s - r) / r if r else float("nan"))
        rows.append(row)
    return rows


def format_errors(rows: list[dict]) -> str:
    lines = [f"{'config':<16}" + "".join(f"{name:>24}" for name in METRICS),
             f"{'':<16}" + "".join(f"{'real / sim / error':>24}" for _ in METRICS)]
    for row in rows:
        cells = []
        for name in METRICS:
            r, s, e = row[name]
            scale = 1.0 if name == "out tok/s" else 1e3
            cells.append(f"{r * scale:>8.1f} /{s * scale:>7.1f} /{e:>+6.1%}")
        lines.append(f"{row['label']:<16}" + "".join(f"{c:>24}" for c in cells))
    return "\n".join(lines)


def add_errors_parser(sub) -> None:
    p = sub.add_parser("errors", help="prediction errors of a simulated bench compare against a real one")
    p.add_argument("real", help="results.json of a real `bench compare`")
    p.add_argument("simulated", help="results.json of the same `bench compare ... --simulate PROFILE`")
    p.set_defaults(func=_main)


def _main(ns) -> int:
    real, sim = (json.loads(Path(p).read_text()) for p in (ns.real, ns.simulated))
    print("latencies in ms; error = (simulated - real) / real")
    print(format_errors(prediction_errors(real, sim)))
    return 0
