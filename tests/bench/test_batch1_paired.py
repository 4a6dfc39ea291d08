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


@pytest.mark.slow
def test_offline_stream_times_every_token_of_one_request(tiny_llama_dir):
    """``--engine offline``: the engine in-process decodes the whole ``ignore_eos`` request and rates its tokens
    after the first; a second request on the same engine is measured alike (the engine stays loaded)."""
    from types import SimpleNamespace

    stream = paired.OfflineStream(str(tiny_llama_dir), 1, 256)
    req = SimpleNamespace(prompt_token_ids=[5, 6, 7, 8], prompt=None)
    for tokens in (24, 9):
        run = stream.decode(req, tokens)
        assert run["tokens"] == tokens and run["ignore_eos_honoured"]
        assert run["tok_s"] > 0
    assert stream.engine.has_unfinished_requests() is False
