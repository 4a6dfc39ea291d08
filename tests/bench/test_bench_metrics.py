"""Metric definitions on hand-made timelines with known answers (vLLM's serving-benchmark definitions)."""

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.bench.metrics import LatencyStats, RequestTiming, format_summary, percentile, summarize


def timing(rid, arrival, token_times, prompt=10, scheduled=None, error=None, output=None):
    return RequestTiming(
        request_id=rid, prompt_tokens=prompt, output_tokens=len(token_times) if output is None else output,
        arrival=arrival, first_token=token_times[0] if token_times else None, token_times=list(token_times),
        finished=None if error else (token_times[-1] if token_times else None), first_scheduled=scheduled,
        error=error,
    )


def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) == 0.0


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_is_within_range_and_monotone(values, q):
    p = percentile(values, q)
    assert min(values) <= p <= max(values)
    assert percentile(values, min(100.0, q + 1)) >= p


def test_ttft_tpot_itl_e2e_queue_on_a_known_timeline():
    # a: arrives 0, scheduled 0.5, tokens at 1.0, 1.2, 1.6 -> TTFT 1.0, TPOT 0.3, ITLs 0.2 0.4, E2E 1.6, queue 0.5
    # b: arrives 1.0, one token at 3.0 -> TTFT 2.0, no TPOT, no ITL, E2E 2.0
    a = timing("a", 0.0, [1.0, 1.2, 1.6], scheduled=0.5)
    b = timing("b", 1.0, [3.0], prompt=20)
    s = summarize([a, b], duration_s=4.0)
    assert s.num_completed == 2 and s.num_failed == 0
    assert s.ttft.mean == pytest.approx(1.5) and s.ttft.max == pytest.approx(2.0)
    assert s.tpot.p50 == pytest.approx(0.3) and s.tpot.max == pytest.approx(0.3)
    assert s.itl.mean == pytest.approx(0.3) and s.itl.p50 == pytest.approx(0.3) and s.itl.max == pytest.approx(0.4)
    assert s.e2e.p50 == pytest.approx(1.8)
    assert s.queue.mean == pytest.approx(0.5)  # only a knows when it was scheduled
    assert s.request_throughput == pytest.approx(0.5)
    assert s.output_throughput == pytest.approx(4 / 4.0)
    assert s.total_throughput == pytest.approx((4 + 30) / 4.0)


def test_tpot_uses_output_tokens_when_a_server_sends_chunks():
    # 5 tokens arrived in 2 chunks: first at 1.0, the rest at 2.0 -> TPOT (2.0 - 1.0) / 4, one ITL of 1.0
    t = timing("a", 0.0, [1.0, 2.0], output=5)
    s = summarize([t], duration_s=2.0)
    assert s.tpot.mean == pytest.approx(0.25)
    assert s.itl.mean == pytest.approx(1.0)


def test_failed_requests_count_but_do_not_enter_latencies_or_throughput():
    ok = timing("ok", 0.0, [0.1, 0.2])
    bad = timing("bad", 0.0, [], error="HTTP 500")
    s = summarize([ok, bad], duration_s=1.0)
    assert (s.num_requests, s.num_completed, s.num_failed) == (2, 1, 1)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.ttft.max == pytest.approx(0.1)


def test_goodput_counts_requests_meeting_every_slo():
    fast = timing("fast", 0.0, [0.05, 0.10, 0.15])  # TTFT 50 ms, TPOT 50 ms, E2E 150 ms
    slow_start = timing("slow", 0.0, [0.5, 0.55])  # TTFT 500 ms
    one_token = timing("one", 0.0, [0.08])  # no TPOT: passes the TPOT SLO
    s = summarize([fast, slow_start, one_token], duration_s=2.0, slo_ms={"ttft": 100, "tpot": 60})
    assert s.goodput == pytest.approx(2 / 2.0)
    assert summarize([fast], 1.0).goodput is None
    with pytest.raises(ValueError):
        summarize([fast], 1.0, slo_ms={"latency": 1})


def test_empty_run_is_all_zeros_and_formats():
    s = summarize([], duration_s=0.0)
    assert s.ttft == LatencyStats() and s.request_throughput == 0.0
    text = format_summary(summarize([timing("a", 0.0, [1.0, 2.0])], 2.0, {"e2e": 5000}), title="demo")
    assert "demo" in text and "Goodput" in text and "P99 ITL (ms):" in text
    assert s.to_dict()["ttft"]["p99"] == 0.0


def test_metrics_module_is_pure_python():
    code = "import sys, conveyor.bench.metrics; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
