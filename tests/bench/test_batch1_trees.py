"""benchmarks/batch1_trees.py end to end on the default model's GGUF: two checkouts (here this one twice) load it in
processes of their own, agree on their greedy tokens, take turns at a round, and the script prints each tree's
rate and the second over the first."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.models.sources import DEFAULT_MODEL, packaged_model_path

REPO = Path(__file__).parents[2]
SCRIPT = REPO / "benchmarks" / "batch1_trees.py"


@pytest.mark.slow  # two engines decode 256 tokens four times each
def test_two_trees_take_turns_and_agree():
    gguf = packaged_model_path(DEFAULT_MODEL)
    done = subprocess.run([sys.executable, str(SCRIPT), "--gguf", str(gguf), "--tree", f"a={REPO}",
                           "--tree", f"b={REPO}", "--rounds", "1", "--threads", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "greedy tokens equal across trees: True" in out
    rates = dict(re.findall(r"(\w+) ([\d.]+)", re.search(r"round 0: (.*)", out).group(1)))
    assert set(rates) == {"a", "b"} and all(float(v) > 0 for v in rates.values())
    ratio = float(re.search(r"b / a per round: median ([\d.]+)", out).group(1))
    assert ratio == pytest.approx(float(rates["b"]) / float(rates["a"]), rel=0.01)  # rates printed to 0.1
