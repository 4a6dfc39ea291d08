"""``bench compare --simulate ... --disaggregate``: the results document, and one colocated instance through the
cluster loop giving exactly the single-engine simulator's numbers."""

from __future__ import annotations

import json

import pytest

from conveyor.bench.workload_gen import longtail, rag
from conveyor.cli import main as conveyor


def compare(tmp_path, name: str, *flags: str) -> dict:
    trace = tmp_path / "trace.json"
    if not trace.exists():
        longtail(num_requests=60, seed=3, rate=30.0).save(str(trace))
    out = tmp_path / name
    assert conveyor(["bench", "compare", "--workload", str(trace), "--simulate", "h100-sxm", "--model",
                     "llama-3-8b", "--policies", "chunked", "--slo", "ttft=200,tpot=20", "--no-plots",
                     "--out", str(out), *flags]) == 0
    return json.loads((out / "results.json").read_text())


def test_one_colocated_instance_is_the_single_engine_simulation(tmp_path):
    single = compare(tmp_path, "single", "--num-kv-blocks", "3000")["runs"][0]
    cluster = compare(tmp_path, "cluster", "--num-kv-blocks", "3000", "--disaggregate", "1C@1")["runs"][0]
    assert cluster["summary"] == single["summary"]
    assert [s["num_scheduled_tokens"] for s in cluster["steps"]] == [s["num_scheduled_tokens"]
                                                                     for s in single["steps"]]


def test_disaggregated_runs_write_the_results_schema_with_goodput(tmp_path):
    doc = compare(tmp_path, "layouts", "--disaggregate", "2C@1,1P1D@1", "--request-rate", "20,40",
                  "--kv-link", "rdma-400g")
    runs = doc["runs"]
    assert [r["label"] for r in runs] == ["2C@1 chunked rate=20", "2C@1 chunked rate=40", "1P1D@1 chunked rate=20",
                                        "1P1D@1 chunked rate=40"]
    for r in runs:
        s = r["summary"]
        assert s["num_completed"] == 60 and s["goodput"] is not None and 0 < s["goodput"] <= s["request_throughput"]
        assert s["ttft"]["p99"] > 0 and s["itl"]["p99"] > 0 and r["cluster"]["gpus"] == 2
        assert all(i["final_kv_usage"] == 0.0 for i in r["cluster"]["instances"])
    p1d1 = runs[2]["cluster"]
    assert [i["role"] for i in p1d1["instances"]] == ["prefill", "decode"]
    assert p1d1["num_transfers"] == 60 and p1d1["link"]["name"] == "rdma-400g"
    assert p1d1["transfer_bytes"] == 2 * 32 * 8 * 128 * 2 * doc["prompt_tokens"]  # Llama-3-8B, bf16


def test_disaggregate_needs_the_simulator(tmp_path):
    with pytest.raises(SystemExit):
        conveyor(["bench", "compare", "--disaggregate", "1P1D", "--out", str(tmp_path)])


def test_rag_workload_is_prefill_heavy_and_fits_an_8k_context():
    w = rag(num_requests=200, seed=1)
    lengths = [len(r.prompt_token_ids) for r in w.requests]
    assert min(lengths) >= 2048 and max(lengths) <= 7168
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 8192 for r in w.requests)
    assert w.num_prompt_tokens > 15 * w.num_output_tokens
