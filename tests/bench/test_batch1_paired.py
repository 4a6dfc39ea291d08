"""benchmarks/batch1_paired.py: a round's ratio is its median stream over llama-bench's rate, and the summary is
the rounds' median and range; the script refuses to run without a llama-bench (the comparison is its point)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "batch1_paired.py"
spec = importlib.util.spec_from_file_location("batch1_paired", SCRIPT)
paired = importlib.util.module_from_spec(spec)
spec.loader.exec_module(paired)


def test_round_ratio_is_the_median_stream_over_llama_bench():
    ratios = [paired.round_ratio(100.0, [150.0, 90.0, 120.0]), paired.round_ratio(200.0, [210.0, 230.0]),
              paired.round_ratio(50.0, [75.0])]
    assert ratios == pytest.approx([1.2, 1.1, 1.5])
    s = paired.summarize(ratios)
    assert s["median"] == pytest.approx(1.2) and s["low"] == pytest.approx(1.1) and s["high"] == pytest.approx(1.5)


def test_needs_a_llama_bench_binary():
    done = subprocess.run([sys.executable, str(SCRIPT), "--gguf", "m.gguf"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--llama-bench" in done.stderr
