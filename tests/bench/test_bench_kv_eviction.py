"""``conveyor bench kv-eviction``: the text it streams ships with Python, and the command runs end to end."""

from __future__ import annotations

import pytest

from conveyor.bench.kv_eviction import long_text
from conveyor.cli import main


def test_the_streamed_text_is_long_and_real():
    text = long_text()
    assert len(text) > 200_000 and "assert" in text  # the stdlib's documentation topics


@pytest.mark.slow  # a real (tiny) model and engine
def test_command_prints_every_policy_and_budget(tiny_llama_dir, capsys):
    assert main(["bench", "kv-eviction", "--model", str(tiny_llama_dir), "--dtype", "float32", "--tokens", "96",
                 "--chunk", "8", "--block-size", "4", "--fractions", "0.5,0.25", "--passkey-lengths", "80",
                 "--passkey-trials", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert sum(1 for r in rows if r.startswith("| sink |") or r.startswith("| h2o |")) == 4
    assert sum(1 for r in rows if r.startswith("| 80 |")) == 1 + 3 * 2  # exact, then 3 policies x 2 budgets
