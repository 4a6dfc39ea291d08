"""Workload generators: seeded, reproducible, the promised shapes, and a trace file that loads back."""

import pytest

from conveyor.bench.workload import load_workload
from conveyor.bench.workload_gen import arrival_times, longtail, shared_prefix, uniform
from conveyor.cli import main


def test_same_seed_same_trace_other_seed_other_trace():
    a, b, c = longtail(50, seed=3), longtail(50, seed=3), longtail(50, seed=4)
    assert a.to_json() == b.to_json()
    assert a.to_json() != c.to_json()


def test_longtail_mixes_short_chat_and_long_rag():
    w = longtail(400, seed=1, rag_fraction=0.2)
    chat = [r for r in w.requests if r.kind == "chat"]
    rag = [r for r in w.requests if r.kind == "rag"]
    assert 0.12 < len(rag) / len(w.requests) < 0.28
    assert all(16 <= r.prompt_len <= 128 and 16 <= r.max_tokens <= 256 for r in chat)
    assert all(256 <= r.prompt_len <= 1024 and 32 <= r.max_tokens <= 384 for r in rag)
    short = sum(r.prompt_len < 45 for r in chat) / len(chat)  # log-uniform: half below sqrt(16 * 128) ~ 45
    assert 0.4 < short < 0.6
    assert all(r.params == {"temperature": 0.0, "ignore_eos": True} for r in w.requests)


def test_shared_prefix_reuses_system_prompts():
    w = shared_prefix(40, num_prefixes=3, prefix_len=64)
    heads = {tuple(r.prompt_token_ids[:64]) for r in w.requests}
    assert len(heads) == 3
    u = uniform(30, prompt_len=(10, 20), output_len=(5, 6))
    assert all(10 <= r.prompt_len <= 20 and r.max_tokens in (5, 6) for r in u.requests)


@pytest.mark.parametrize("arrival,burstiness", [("poisson", 1.0), ("gamma", 0.25), ("gamma", 4.0)])
def test_arrivals_have_the_requested_rate(arrival, burstiness):
    import random

    times = arrival_times(4000, arrival, 8.0, random.Random(0), burstiness)
    assert times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(1 / 8.0, rel=0.1)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    mean = sum(gaps) / len(gaps)
    cv2 = sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean**2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.25)  # gamma: squared coefficient of variation = 1 / shape
    assert arrival_times(3, "all-at-once", None, random.Random(0)) == [0.0, 0.0, 0.0]


def test_cli_writes_a_trace_that_loads_back(tmp_path):
    out = tmp_path / "w.json"
    assert main(["bench", "workload", "longtail", "--num-requests", "12", "--request-rate", "2", "--out",
                 str(out)]) == 0
    w = load_workload(out)
    ref = longtail(12, seed=1, rate=2.0)
    assert [r.prompt_token_ids for r in w.requests] == [r.prompt_token_ids for r in ref.requests]
    assert [r.arrival_s for r in w.requests] == pytest.approx([r.arrival_s for r in ref.requests], abs=1e-5)
    assert w.requests[0].sampling_params().ignore_eos


def test_cli_shapes_the_shared_prefix_workload(tmp_path):
    out = tmp_path / "sp.json"
    assert main(["bench", "workload", "shared-prefix", "--num-requests", "60", "--num-prefixes", "12",
                 "--prefix-len", "32", "--out", str(out)]) == 0
    heads = {tuple(r.prompt_token_ids[:32]) for r in load_workload(str(out)).requests}
    assert 8 <= len(heads) <= 12  # 60 draws among 12 system prompts of 32 tokens
    with pytest.raises(SystemExit, match="shared-prefix"):
        main(["bench", "workload", "uniform", "--num-prefixes", "3", "--out", str(out)])


def test_cli_shapes_rag_lengths_and_kv_budgets(tmp_path):
    out = tmp_path / "rag.json"
    assert main(["bench", "workload", "rag", "--num-requests", "20", "--prompt-len", "300,400", "--output-len",
                 "20,30", "--kv-budget-fraction", "0.25", "--out", str(out)]) == 0
    reqs = load_workload(str(out)).requests
    assert all(300 <= r.prompt_len <= 400 and 20 <= r.max_tokens <= 30 for r in reqs)
    assert [r.sampling_params().kv_budget_tokens for r in reqs] == [r.prompt_len // 4 for r in reqs]
    with pytest.raises(SystemExit, match="rag and uniform"):
        main(["bench", "workload", "longtail", "--prompt-len", "3,4", "--out", str(out)])
    with pytest.raises(SystemExit, match="fraction"):
        main(["bench", "workload", "rag", "--kv-budget-fraction", "1.5", "--out", str(out)])


def test_packaged_trace_by_name_and_by_path(tmp_path):
    from conveyor.bench.workload import packaged_workloads, workload_path

    assert "longtail_v1" in packaged_workloads()
    w = load_workload("longtail_v1")
    assert (w.name, len(w.requests), w.num_prompt_tokens, w.num_output_tokens) == \
        ("workload_longtail_v1", 100, 15702, 8861)
    assert load_workload("workload_longtail_v1").num_prompt_tokens == 15702  # the file's own name works too
    copy = tmp_path / "copy.json"
    copy.write_bytes(workload_path("longtail_v1").read_bytes())
    assert load_workload(copy).requests[7] == w.requests[7]
    with pytest.raises(FileNotFoundError, match="neither a file nor a packaged trace"):
        load_workload("longtail_v9")
