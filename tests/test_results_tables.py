"""The measurement history in docs/results/*.csv, the tables scripts/results_tables.py renders from it, and the
README's promises (short, with the two set-up commands)."""

from __future__ import annotations

import csv
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"

spec = importlib.util.spec_from_file_location("results_tables", REPO / "scripts" / "results_tables.py")
rt = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = rt  # dataclasses look their module up while the file runs
spec.loader.exec_module(rt)

DATA = sorted(p for p in RESULTS.glob("*.csv") if p.name != "commands.csv")


def test_every_csv_is_rendered_by_some_table():
    assert DATA, "no data in docs/results"
    assert {p.name for p in DATA} == {t.csv for t in rt.TABLES.values()}


@pytest.mark.parametrize("path", DATA, ids=lambda p: p.name)
def test_every_row_says_where_it_came_from(path):
    commands = rt.commands()
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows
    for i, row in enumerate(rows, start=2):
        for col in rt.PROVENANCE:
            assert col in row, f"{path.name} has no {col} column"
        for col in rt.REQUIRED:
            assert row[col].strip(), f"{path.name} line {i}: empty {col}"
        assert re.fullmatch(r"2026-\d\d-\d\d", row["date"]), f"{path.name} line {i}: date {row['date']!r}"
        assert re.fullmatch(r"[0-9a-f]{7,40}|unrecorded", row["commit"]), f"{path.name} line {i}: {row['commit']!r}"
        if row["commit"] == "unrecorded":  # then it must say where the number was first written down
            assert re.fullmatch(r"[0-9a-f]{7,40}|PEERS\.md", row["recorded_in"]), f"{path.name} line {i}"
        assert row["command"] in commands, f"{path.name} line {i}: command {row['command']!r} not in commands.csv"
        assert row["load"].strip(), f"{path.name} line {i}: no load note (write 'not recorded' if unknown)"


@pytest.mark.parametrize("name", list(rt.TABLES))
def test_rendered_table_carries_every_row(name):
    table = rt.TABLES[name]
    lines, placed = rt.render_rows(name)
    rows = table.rows()
    assert rows, f"{name} selects no rows"
    assert [id(r) for r, _ in placed] and len(placed) == len(rows)
    first_line: dict[tuple, int] = {}
    for row, at in placed:
        for col in table.columns + table.pivot_cells:
            cell = col.cell(row)
            for f in col.fields():  # the cell shows every value of the row (or the label standing for it)
                if row[f]:
                    assert col.labels.get(row[f], row[f]) in cell, f"{name}: {f}={row[f]!r} not in {cell!r}"
            # a column shown once per group carries the value on the group's first line
            key = (col.header,) + tuple(row[f] for f in col.once_per)
            line = lines[first_line.setdefault(key, at) if col.once_per else at]
            assert cell in line, f"{name}: {cell!r} missing from {line!r}"
    text = rt.render(name)
    for row in rows:  # the caption names every row's CPU, date and commit
        assert row["cpu"] in text and row["date"] in text
        assert (row["commit"] if row["commit"] != "unrecorded" else "not recorded") in text


def test_pivot_keeps_the_cells_of_one_run_in_order():
    lines, placed = rt.render_rows("side-by-side-history")
    by_line: dict[int, list[str]] = {}
    for row, at in placed:
        by_line.setdefault(at, []).append(row["ratio"])
    for at, ratios in by_line.items():
        assert " / ".join(ratios) in lines[at]


def test_generated_blocks_are_up_to_date():
    assert rt.main(["--check"]) == 0, "run: python scripts/results_tables.py --write"
    blocks = [m[2] for p in rt.markdown_files() for m in rt.BLOCK.finditer(p.read_text())]
    assert set(blocks) <= set(rt.TABLES)
    assert "side-by-side-latest" in blocks


def test_readme_is_a_short_guide_with_the_two_setup_commands():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 260
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in readme
    assert ".venv/bin/conveyor bench offline --workload longtail_v1" in readme
    # commands a reader runs name no path of the developers' machine
    assert "../shared" not in readme and "../peers" not in readme and "/work/" not in readme


def test_docs_links_resolve():
    others = {"architecture.md", "kernels.md"}  # kept by the engine and kernel work, not by this page set
    for path in (p for p in rt.markdown_files() if p.name not in others):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target or Path(target).name in others:  # those pages come with their own work
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(REPO)} links to missing {target}"
