"""``conveyor bench mixed``: on the simulator (the real scheduler, a 70B model on H100s) the batch at the lowest
priority leaves the interactive stream's first tokens where FCFS delays them, the step slack bounds what it adds to
a decode step, and SLO-aware admission refuses rather than admits to miss; over HTTP against a real server every
mode runs (the Batch API job included)."""

from __future__ import annotations

import argparse
import json

import pytest

from conveyor.bench.cli import add_bench_parser
from tests.helpers.server import make_engine, running_server


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", "mixed", *argv])


SIM = ("--simulate", "h100-sxm", "--model", "llama-3-70b", "--tensor-parallel-size", "4", "--kv-cache-memory", "100",
       "--interactive-requests", "40", "--request-rate", "4", "--batch-requests", "400", "--batch-concurrency", "200",
       "--max-num-seqs", "64")


def run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "mixed.json"
    ns = parse(*SIM, *argv, "--json", str(out))
    assert ns.func(ns) == 0
    return {r["mode"]: r for r in json.loads(out.read_text())["results"]}


def test_simulated_priority_keeps_first_tokens_where_fcfs_delays_them(tmp_path):
    r = run(tmp_path, "--mode", "alone", "--mode", "batch-api", "--mode", "fcfs", "--mode", "offline")
    alone, batch, fcfs = (r[m]["interactive"] for m in ("alone", "batch-api", "fcfs"))
    assert fcfs["ttft"]["p99"] > 5 * batch["ttft"]["p99"], (fcfs["ttft"], batch["ttft"])
    assert r["batch-api"]["output_throughput"] > 5 * r["alone"]["output_throughput"], "idle slots filled"
    assert r["offline"]["batch_done"] == 400 and r["offline"]["interactive"]["num_requests"] == 0
    assert alone["num_completed"] == batch["num_completed"] == 40


def test_simulated_step_slack_bounds_the_decode_step(tmp_path):
    free = run(tmp_path, "--mode", "batch-api")["batch-api"]
    slack = run(tmp_path, "--mode", "batch-api", "--priority-step-slack", "0.15")["batch-api"]
    assert slack["interactive"]["tpot"]["p50"] < free["interactive"]["tpot"]["p50"]
    assert slack["output_tokens"] < free["output_tokens"]  # the price: less batch work per step


def test_simulated_admission_refuses_what_would_miss_and_reports_its_error(tmp_path):
    tight = ("--request-rate", "200", "--interactive-requests", "100", "--mode", "alone", "--slo-ttft-ms", "150",
             "--slo-tpot-ms", "100")
    without = run(tmp_path, *tight)["alone"]
    with_admission = run(tmp_path, *tight, "--service-class", "interactive:ttft=150,tpot=100")["alone"]
    assert without["refused"] == 0 and with_admission["refused"] > 0
    assert with_admission["interactive"]["goodput"] > 1.2 * without["interactive"]["goodput"]
    keys = {f"{what}_{key}_p{q}" for what in ("ttft", "tpot") for key in ("abs_error_s", "measured_over_predicted")
            for q in (50, 90)}
    assert set(with_admission["prediction"]) == keys


@pytest.mark.slow
def test_every_mode_over_http_against_a_real_server(tiny_chat_dir, tmp_path):
    from conveyor.core.policies import BATCH_PRIORITY
    from conveyor.server.app import build_app
    from conveyor.server.batches.setup import BatchAPIConfig

    app = build_app(make_engine(tiny_chat_dir), "tiny", None, log_stats_interval_s=0.0, shutdown_timeout_s=2.0,
                    batches=BatchAPIConfig(str(tmp_path / "state"), concurrency=4, priority=BATCH_PRIORITY))
    with running_server(app) as url:
        out = tmp_path / "http.json"
        ns = parse("--base-url", url, "--interactive-requests", "6", "--request-rate", "20", "--batch-requests", "12",
                   "--batch-concurrency", "4", "--prompt-len", "4,8", "--output-len", "4,8", "--batch-prompt-len", "4,8",
                   "--batch-output-len", "16,32", "--vocab-size", "30", "--slo-ttft-ms", "60000", "--json", str(out))
        assert ns.func(ns) == 0
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"alone", "offline", "batch-api", "fcfs", "low-priority"}
    assert results["offline"]["batch_done"] == 12 and results["offline"]["output_tokens"] > 0
    for mode in ("alone", "batch-api", "fcfs", "low-priority"):
        assert results[mode]["interactive"]["num_completed"] == 6, results[mode]
        assert results[mode]["interactive"]["goodput"] > 0
        sent, ttfts = zip(*results[mode]["ttfts"])  # per request, in sending order
        assert len(ttfts) == 6 and list(sent) == sorted(sent) and all(t is not None and t > 0 for t in ttfts)


def test_a_result_lists_ttfts_by_time_sent_when_a_refused_request_shares_its_millisecond():
    # at 24 req/s two requests were sent in one millisecond, one refused (429: no first token); the list of
    # (sent, TTFT) pairs is in sending order, not a comparison of None with a TTFT
    from conveyor.bench.metrics import RequestTiming
    from conveyor.bench.mixed import result_of
    served = RequestTiming("a", 10, 5, 1.0002, 1.05, [1.05, 1.06], 1.1)
    refused = RequestTiming("b", 10, 0, 1.0001, None, [], None, error="429")
    result = result_of("alone", [served, refused, RequestTiming("c", 10, 5, 0.5, 0.6, [0.6], 0.7)], 2.0, 10,
                       {"ttft": 1000.0}, [0.01], 0)
    assert result.ttfts == [[0.5, 0.1], [1.0, 0.05], [1.0, None]]
