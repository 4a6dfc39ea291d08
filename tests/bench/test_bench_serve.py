"""``conveyor bench serve`` against a real server (tiny model on 127.0.0.1)."""

from __future__ import annotations

import json
import random

import pytest

from conveyor.bench.serve_client import schedule
from conveyor.bench.workload import Workload, WorkloadRequest
from conveyor.cli import main
from tests.helpers.checkpoints import TINY_VOCAB
from tests.helpers.server import serve_model

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"


def make_workload(n: int, vocab: int = TINY_VOCAB, text: bool = False) -> Workload:
    rng = random.Random(3)
    reqs = []
    for i in range(n):
        ids = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 40))]
        prompt = " ".join(f"w{t}" for t in ids) if text else None
        reqs.append(WorkloadRequest(i, 0.02 * i, None if text else ids, prompt, rng.randint(2, 12), "chat",
                                    {"temperature": 0.0, "ignore_eos": True}))
    return Workload("tiny-trace", reqs, seed=3, arrival_rate_req_s=50.0)


@pytest.fixture(scope="module")
def server_url(tiny_llama_dir):
    with serve_model(tiny_llama_dir) as (url, _):
        yield url


@pytest.mark.parametrize("text", [False, True], ids=["token-ids", "text"])
def test_bench_serve_replays_trace(server_url, tmp_path, capsys, text):
    workload = make_workload(12, text=text)
    workload.save(tmp_path / "w.json")
    rc = main(["bench", "serve", "--base-url", server_url, "--workload", str(tmp_path / "w.json"),
               "--slo-ttft-ms", "60000", "--json", str(tmp_path / "out.json")])
    assert rc == 0
    assert "TTFT" in capsys.readouterr().out
    result = json.loads((tmp_path / "out.json").read_text())
    s = result["summary"]
    assert s["num_completed"] == 12 and s["num_failed"] == 0 and s["goodput"] > 0
    outputs = sorted((r["request_id"], r["output_tokens"]) for r in result["requests"])
    assert outputs == sorted((str(r.id), r.max_tokens) for r in workload.requests)  # ignore_eos: exact lengths
    assert s["ttft"]["p50"] > 0 and s["e2e"]["p99"] >= s["e2e"]["p50"]


def test_bench_serve_all_at_once_with_concurrency_cap(server_url, tmp_path):
    make_workload(8).save(tmp_path / "w.json")
    rc = main(["bench", "serve", "--base-url", server_url, "--workload", str(tmp_path / "w.json"),
               "--request-rate", "inf", "--max-concurrency", "2", "--json", str(tmp_path / "out.json")])
    assert rc == 0 and json.loads((tmp_path / "out.json").read_text())["summary"]["num_completed"] == 8


def test_refused_token_prompts_are_explained(server_url, tmp_path, capsys):
    make_workload(3, vocab=32000).save(tmp_path / "w.json")  # ids beyond the tiny vocabulary: 400
    rc = main(["bench", "serve", "--base-url", server_url, "--workload", str(tmp_path / "w.json")])
    assert rc == 1
    assert "token ids" in capsys.readouterr().err


def test_schedule_replays_or_draws_seeded_arrivals():
    w = make_workload(50)
    assert schedule(w, None, 1.0, 0) == [r.arrival_s for r in w.requests]
    assert schedule(w, float("inf"), 1.0, 0) == [0.0] * 50
    poisson = schedule(w, 10.0, 1.0, 7)
    assert poisson == schedule(w, 10.0, 1.0, 7) and poisson == sorted(poisson)
    assert 2.0 < poisson[-1] < 10.0  # 50 arrivals at 10/s: about 5 s
    bursty = schedule(w, 10.0, 0.2, 7)
    assert bursty != poisson and 1.0 < bursty[-1] < 25.0


def test_compare_url_replays_the_same_trace_against_a_second_server(server_url, tmp_path, capsys):
    workload = make_workload(6)
    workload.save(tmp_path / "w.json")
    rc = main(["bench", "serve", "--base-url", server_url, "--compare-url", server_url, "--names", "first,second",
               "--warmup", "2", "--workload", str(tmp_path / "w.json"), "--json", str(tmp_path / "out.json")])
    assert rc == 0
    out = capsys.readouterr().out
    table = out[out.index("| server |"):].splitlines()
    assert [row.split("|")[1].strip() for row in table[2:4]] == ["first", "second"]
    runs = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert [r["name"] for r in runs] == ["first", "second"]
    for run in runs:  # the same requests, each with its full output (ignore_eos)
        assert sorted((r["request_id"], r["output_tokens"]) for r in run["requests"]) == \
            sorted((str(r.id), r.max_tokens) for r in workload.requests)
