"""PNG plots of a comparison (matplotlib, Agg backend), from the results document of ``compare.py``.

- latency CDFs (TTFT, ITL, E2E), one line per configuration;
- tokens per step (useful / padding / idle-slot) and batch size over time, one panel per configuration;
- slot timelines: which request occupies each slot at each step (the conveyor belt), wasted slots in red;
- throughput and p99 latency vs offered load, when arrival rates were swept;
- one knob-sweep plot per swept knob.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from conveyor.bench.engine_metrics import assign_slots, slot_intervals  # noqa: E402

MAX_TIMELINES = 8  # slot timelines drawn (one PNG each); more would bury the report
SLOT_COLORS = ["white", "#4c72b0", "#55a868", "#c44e52"]  # empty, prefill, decode, idle slot (wasted)


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") or "run"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdfs(runs: list[dict], path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (name, title) in zip(axes, (("ttft", "TTFT"), ("itl", "inter-token latency"), ("e2e", "E2E latency"))):
        for run in runs:
            values = []
            for t in run["timings"]:
                if name == "ttft" and t["first_token"] is not None:
                    values.append(t["first_token"] - t["arrival"])
                elif name == "e2e" and t["finished"] is not None:
                    values.append(t["finished"] - t["arrival"])
                elif name == "itl":
                    tt = t["token_times"]
                    values += [b - a for a, b in zip(tt, tt[1:])]
            values.sort()
            if values:
                n = len(values)
                ax.step([v * 1e3 for v in values], [(i + 1) / n for i in range(n)], where="post", label=run["label"])
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} (ms, log scale)")
        ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of token gaps")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def plot_over_time(runs: list[dict], path: Path) -> Path:
    fig, axes = plt.subplots(len(runs), 1, figsize=(13, 2.3 * len(runs) + 0.6), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        steps = run["steps"]
        t = [s["start"] for s in steps]
        useful = [s["num_prefill_tokens"] + s["num_decode_tokens"] - s["num_idle_slot_tokens"] for s in steps]
        pad = [s["num_padding_tokens"] for s in steps]
        idle = [s["num_idle_slot_tokens"] for s in steps]
        ax.stackplot(t, useful, pad, idle, step="post", colors=["#55a868", "#dd8452", "#c44e52"],
                     labels=["useful tokens", "padding", "idle-slot"])
        ax.set_yscale("symlog", linthresh=10)
        ax.set_ylabel("tokens / step")
        ax.set_title(run["label"], fontsize=9, loc="left")
        ax2 = ax.twinx()
        ax2.step(t, [s["num_reqs"] for s in steps], where="post", color="black", lw=0.8, label="batch size")
        ax2.set_ylabel("batch size")
        ax2.set_ylim(bottom=0)
    axes[0, 0].legend(loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("time since start (s)")
    fig.suptitle("Tokens computed per step (stacked, symlog) and requests per step (black) over time")
    return _save(fig, path)


def slot_grid(run: dict) -> tuple[list[float], list[list[int]]]:
    """Time edges of the steps and a [slot][step] grid of 0 empty, 1 prefill, 2 decode, 3 idle slot."""
    steps = run["steps"]
    finished = {t["request_id"]: t["finished"] for t in run["timings"]}
    slot_of = assign_slots(slot_intervals([s["num_scheduled_tokens"] for s in steps]))
    grid = [[0] * len(steps) for _ in range(max(slot_of.values(), default=-1) + 1)]
    for j, s in enumerate(steps):
        for rid, n in s["num_scheduled_tokens"].items():
            done = finished.get(rid)
            kind = 3 if done is not None and s["start"] >= done else (1 if n > 1 else 2)
            grid[slot_of[rid]][j] = kind
    edges = [s["start"] for s in steps] + ([steps[-1]["end"]] if steps else [])
    return edges, grid


def plot_slot_timeline(run: dict, path: Path) -> Path:
    edges, grid = slot_grid(run)
    fig, ax = plt.subplots(figsize=(13, 0.08 * len(grid) + 2.2))
    if grid:
        ax.pcolormesh(edges, list(range(len(grid) + 1)), grid, cmap=ListedColormap(SLOT_COLORS), vmin=0, vmax=3,
                      shading="flat")
    ax.invert_yaxis()
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("slot")
    e = run["engine"]
    ax.set_title(f"Slot timeline, {run['label']}: who occupies each slot at each step "
                 f"(wasted: {e['wasted_fraction']:.0%} of computed tokens)", fontsize=10)
    ax.legend(handles=[Patch(color=c, label=n) for c, n in zip(SLOT_COLORS[1:], ("prefill (chunk)", "decode",
                                                                               "idle slot (wasted)"))],
              loc="upper right", fontsize=8)
    return _save(fig, path)


def _series(runs: list[dict], x_of, group_of):
    groups: dict[str, list[tuple[float, dict]]] = {}
    for run in runs:
        x = x_of(run)
        if x is not None:
            groups.setdefault(group_of(run), []).append((x, run))
    return {g: sorted(v, key=lambda p: p[0]) for g, v in groups.items()}


def plot_vs(runs: list[dict], x_of, group_of, xlabel: str, title: str, path: Path, log_x: bool = False) -> Path:
    """Output throughput and p99 TTFT / ITL against one variable, a line per group of the other knobs."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("output tok/s", lambda r: r["summary"]["output_throughput"]),
              ("p99 TTFT (s)", lambda r: r["summary"]["ttft"]["p99"]),
              ("p99 ITL (ms)", lambda r: r["summary"]["itl"]["p99"] * 1e3))
    for ax, (ylabel, get) in zip(axes, panels):
        for group, points in _series(runs, x_of, group_of).items():
            ax.plot([p[0] for p in points], [get(p[1]) for p in points], marker="o", label=group)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if log_x:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def write_plots(results: dict, out: Path) -> list[Path]:
    """Every plot that applies to these results; returns their paths."""
    runs = results["runs"]
    paths = [plot_latency_cdfs(runs, out / "latency_cdfs.png"), plot_over_time(runs, out / "tokens_per_step.png")]
    for run in runs[:MAX_TIMELINES]:
        paths.append(plot_slot_timeline(run, out / f"slots_{_slug(run['label'])}.png"))
    rates = {r["request_rate"] for r in runs}
    if len(rates) > 1:
        # x: the requested mean rate (a short trace's realised rate, ``offered_rate``, scatters around it)
        paths.append(plot_vs(runs, lambda r: r["request_rate"], lambda r: _without(r["label"], "rate="),
                             "offered load: mean request rate (req/s)", "Throughput and tail latency vs offered load",
                             out / "load_sweep.png"))
    for knob in ("max_num_seqs", "max_wait_ms", "block_size", "max_num_batched_tokens", "kv_cache_memory"):
        values = {r["overrides"].get(knob) for r in runs} - {None}
        if len(values) > 1:
            paths.append(plot_vs(runs, lambda r, k=knob: r["overrides"].get(k),
                                 lambda r, k=knob: _group_label(r, k), knob, f"Sweep of {knob}",
                                 out / f"sweep_{knob}.png", log_x=min(values) > 0))
    return paths


KNOB_PREFIX = {"max_num_seqs": "B=", "max_wait_ms": "wait=", "block_size": "bs=", "max_num_batched_tokens": "T=",
               "kv_cache_memory": "kv="}


def _group_label(run: dict, knob: str) -> str:
    return _without(run["label"], KNOB_PREFIX[knob])


def _without(label: str, prefix: str) -> str:
    return " ".join(p for p in label.split() if not p.startswith(prefix)) or "all"
