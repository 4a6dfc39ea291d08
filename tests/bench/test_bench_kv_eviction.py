"""``conveyor bench kv-eviction``: the text it streams ships with Python, and the command runs end to end."""

from __future__ import annotations

import pytest

from conveyor.bench.kv_eviction import long_text
from conveyor.cli import main


def test_the_streamed_text_is_long_and_real():
    text = long_text()
    assert len(text) > 200_000 and "assert" in text  # the stdlib's documentation topics


@pytest.mark.slow  # a real (tiny) model and engine
def test_command_prints_every_policy_and_budget(tiny_llama_dir, capsys, tmp_path):
    plot = tmp_path / "quality.png"
    assert main(["bench", "kv-eviction", "--model", str(tiny_llama_dir), "--dtype", "float32", "--tokens", "96",
                 "--chunk", "8", "--block-size", "4", "--fractions", "0.5,0.25", "--passkey-lengths", "80",
                 "--passkey-trials", "2", "--chat-tokens", "24", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    ppl = [r for r in rows if r.split("|")[3].strip().isdigit()]  # budget tokens: the perplexity table
    assert len(ppl) == 1 + 2 * 2  # exact, then sink and h2o x 2 budgets
    assert sum(1 for r in rows if r.startswith("| 80 |")) == 1 + 3 * 2  # exact, then 3 policies x 2 budgets
    chat = rows[rows.index(next(r for r in rows if "identical answers" in r)) + 1:]
    assert len(chat) == 3 * 2
    for r in chat:
        same, prefix = float(r.split("|")[3]), float(r.split("|")[4])
        assert 0 <= same <= prefix <= 1  # an identical answer agrees all the way
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_greedy_agreement_counts_identical_answers_and_the_share_before_a_difference():
    from conveyor.bench.kv_eviction import greedy_agreement

    assert greedy_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 3, 4], [5, 6]]) == (1.0, 1.0)
    assert greedy_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 0, 4], [7, 6]]) == (0.0, (0.5 + 0.0) / 2)


@pytest.mark.slow  # a real (tiny) model and engine
def test_trace_at_equal_kv_memory_admits_more_requests_under_eviction(tiny_llama_dir):
    from conveyor.bench.kv_eviction_trace import rag_cases, run_trace
    from conveyor.engine.args import EngineArgs
    from conveyor.engine.llm_engine import LLMEngine

    def engine(**knobs):
        return LLMEngine(EngineArgs(model=str(tiny_llama_dir), dtype="float32", block_size=4, num_kv_blocks=60,
                                    max_model_len=200, enable_prefix_caching=False, debug_invariants=True, **knobs))

    cases = rag_cases(list(range(4, 384)) * 2, 6, (120, 160), (20, 30), seed=1)
    exact = run_trace(engine(), cases, None, "none")
    evicting = run_trace(engine(kv_eviction="h2o"), cases, 0.25, "h2o")
    # the same work: every answer whole
    assert exact.output_tokens == evicting.output_tokens == sum(n for _, n in cases)
    assert exact.evicted_blocks == 0 < evicting.evicted_blocks
    # 60 blocks hold one 160 + 30-token request whole (48 blocks), but all six at a quarter of their prompts
    assert exact.peak_running < evicting.peak_running == 6
    assert evicting.mean_running > exact.mean_running


@pytest.mark.slow
def test_command_runs_the_trace(tiny_llama_dir, capsys):
    assert main(["bench", "kv-eviction", "--model", str(tiny_llama_dir), "--dtype", "float32", "--tokens", "32",
                 "--chunk", "8", "--block-size", "4", "--policies", "", "--fractions", "", "--trace", "3",
                 "--trace-prompt-len", "60,90", "--trace-output-len", "5,10", "--trace-configs",
                 "none,none@fit,h2o,sink@2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    labels = [r.split("|")[1].strip() for r in rows]
    # the pool holds 3 requests of the longest length (3 x 25 blocks): @fit runs at most 3
    assert labels[-4:] == ["none (exact)", "none (exact), at most 3 running", "h2o, 25%",
                           "sink, at most 2 running, 25%"]
    assert all(int(r.split("|")[-2]) > 0 for r in rows[-2:])  # both evicting configurations gave blocks back
