"""Baselines on a real (tiny, random) model: every policy and KV layout gives one-at-a-time greedy outputs; the
in-process replay and ``bench compare`` run end to end. float64, as in test_engine.py, so near-ties cannot flip."""

from __future__ import annotations

import json

import pytest

from conveyor import LLM, SamplingParams
from conveyor.bench.workload import Workload, WorkloadRequest
from tests.helpers.engine import make_prompts, token_ids

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)  # >= every max_tokens below


def make_llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float64", debug_invariants=True, detokenize=False, **kw)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(8, seed=1)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts):
    llm = make_llm(tiny_llama_dir, max_num_seqs=1, policy="continuous", enable_prefix_caching=False)
    return [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]


@pytest.mark.parametrize("layout", ["paged", "slab"])
@pytest.mark.parametrize("policy", ["static", "dynamic", "continuous", "chunked"])
def test_every_policy_and_layout_equals_one_at_a_time(tiny_llama_dir, prompts, reference, policy, layout):
    # max_model_len 128 with 24 blocks of 16: 3 slabs, so the slab layout really caps concurrency here.
    llm = make_llm(tiny_llama_dir, policy=policy, kv_layout=layout, max_num_seqs=3, max_model_len=128,
                   num_kv_blocks=24, max_num_batched_tokens=32)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    outs = token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert outs == [ref[: 4 + 2 * i] for i, ref in enumerate(reference)]


def tiny_workload(n: int, gap_s: float) -> Workload:
    reqs = [WorkloadRequest(i, i * gap_s, p["prompt_token_ids"], None, 3 + i, "t", {"ignore_eos": True, "temperature": 0.0})
            for i, p in enumerate(make_prompts(n, seed=2))]
    return Workload("tiny", reqs)


def test_replay_records_requests_and_steps(tiny_llama_dir):
    from conveyor.bench.engine_metrics import engine_stats
    from conveyor.bench.online import replay

    engine = make_llm(tiny_llama_dir, policy="static", max_num_seqs=2).engine
    result = replay(engine, tiny_workload(4, gap_s=0.02))
    assert sorted(t.request_id for t in result.timings) == ["0", "1", "2", "3"]
    for t in result.timings:
        assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished <= result.duration_s
        assert len(t.token_times) == t.output_tokens == int(t.request_id) + 3
    stats = engine_stats(result.steps, result.duration_s)
    assert stats.idle_slot_tokens > 0 and 0 < stats.wasted_fraction < 1
    assert stats.peak_concurrency <= 2 and not engine.has_unfinished_requests()


def test_bench_compare_end_to_end(tiny_llama_dir, tmp_path):
    from conveyor.cli import build_parser

    trace = tmp_path / "w.json"
    tiny_workload(5, gap_s=0.0).save(trace)
    out = tmp_path / "out"
    ns = build_parser().parse_args([
        "bench", "compare", "--model", str(tiny_llama_dir), "--workload", str(trace), "--out", str(out),
        "--policies", "static,chunked", "--max-num-seqs", "2,4", "--kv-layout", "paged,slab",
        "--max-model-len", "128", "--num-kv-blocks", "32", "--offline", "--no-warmup"])
    ns.dtype = "float64"  # not a CLI choice; here so that near-ties cannot flip between batch shapes
    assert ns.func(ns) == 0
    results = json.loads((out / "results.json").read_text())
    assert len(results["runs"]) == 8
    outputs = [r["output_token_ids"] for r in results["runs"]]
    assert all(o == outputs[0] for o in outputs)  # no configuration changes a greedy output
    assert (out / "report.md").exists() and (out / "latency_cdfs.png").stat().st_size > 0
    assert (out / "sweep_max_num_seqs.png").exists()
