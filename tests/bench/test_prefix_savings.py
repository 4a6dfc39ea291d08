"""What the prefix cache saved, from step records: tokens, FLOPs, seconds, hit rate, the by-prefix table."""

import pytest

from conveyor.bench.prefix_savings import prefix_savings
from conveyor.bench.report import prefix_section
from conveyor.core.block_pool import hash_block
from conveyor.engine.step_record import StepRecord


def _step(start, end, prefill, cached, admitted):
    return StepRecord(start, len(cached), prefill, 0, 0, 0, end=end, num_cached_tokens=cached,
                      num_admitted_tokens=admitted)


def test_savings_of_known_steps():
    steps = [_step(0.0, 1.0, 100, {"a": 0}, 100),  # a miss: 100 tokens computed in 1 s
             _step(1.0, 1.5, 10, {"b": 32, "c": 16}, 60)]  # two hits, 10 tokens computed in 0.5 s
    p = prefix_savings(steps, flops_per_token=10.0, flops_per_key=1.0,
                       prompts={"a": [1] * 100, "b": [1] * 40, "c": [2] * 20}, block_size=16)
    assert (p.saved_tokens, p.admitted_tokens) == (48, 160)
    assert p.hit_rate == pytest.approx(48 / 160)
    assert p.saved_flops == pytest.approx(10.0 * 48 + (32 * 33 / 2 + 16 * 17 / 2))
    assert p.saved_seconds == pytest.approx(48 * 0.5 / 10)  # at the admitting step's rate
    assert p.saved_seconds_at_peak == pytest.approx(48 / 100)  # at the fastest step's (100 tokens/s)
    by_key = {r["prefix"]: r for r in p.top_prefixes}
    ones = by_key[hash_block(None, [1] * 16).hex()[:12]]  # a and b share their first block
    assert (ones["requests"], ones["prompt_tokens"], ones["saved_tokens"]) == (2, 140, 32)
    assert by_key[hash_block(None, [2] * 16).hex()[:12]]["hit_rate"] == pytest.approx(16 / 20)


def test_the_report_section_lists_runs_and_their_top_prefixes():
    p = prefix_savings([_step(0.0, 1.0, 10, {"a": 16}, 20)], 1.0, 1.0, {"a": [3] * 20}, block_size=16)
    lines = prefix_section({"runs": [{"label": "chunked evict=cost", "prefix": p.to_dict()}]})
    text = "\n".join(lines)
    assert "| chunked evict=cost | 80.0% | 16 |" in text and "Top prefixes, chunked evict=cost" in text
    assert prefix_section({"runs": [{"label": "old results", "summary": {}}]}) == []
