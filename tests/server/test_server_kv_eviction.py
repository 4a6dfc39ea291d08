"""KV eviction over HTTP (issue #27): a request's ``kv_budget_tokens`` reaches the engine, the blocks it gives
back show on ``/metrics`` (``conveyor:kv_evicted_blocks``), and a bad or inapplicable budget is a 400 that names
the field while the server keeps serving. ``conveyor serve`` in its default layout (the engine in its own
process), the tiny Llama, the official ``openai`` client."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.helpers.load import start_serve
from tests.helpers.server import wait_for

pytestmark = pytest.mark.slow  # a real server subprocess

PROMPT = list(range(40, 100))  # 60 token ids: several blocks of 8 over a 16-token budget


def evicted_blocks(url: str) -> float:
    found = re.findall(r"^conveyor:kv_evicted_blocks_total\{[^}]*\} (\S+)$", httpx.get(url + "/metrics").text, re.M)
    assert len(found) == 1, "the counter is exported once, for the one served model"
    return float(found[0])


def serve(model_dir, log_path, *extra):
    return start_serve(str(model_dir), log_path, extra=("--dtype", "float32", "--block-size", 8, *extra))


@pytest.fixture(scope="module")
def h2o_server(tiny_llama_dir, tmp_path_factory):
    served = serve(tiny_llama_dir, tmp_path_factory.mktemp("kv-evict") / "serve.log", "--kv-eviction", "h2o")
    yield served
    served.stop(timeout_s=30)


def test_a_requests_budget_evicts_and_the_metric_counts_the_blocks(h2o_server):
    client = openai.OpenAI(base_url=h2o_server.url + "/v1", api_key="none", max_retries=0)
    exact = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert exact.usage.completion_tokens == 20
    assert evicted_blocks(h2o_server.url) == 0  # no budget (none given, no --kv-budget-tokens): the exact cache
    cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0.0,
                                    extra_body={"ignore_eos": True, "kv_budget_tokens": 16})
    assert cut.usage.completion_tokens == 20 and cut.choices[0].finish_reason == "length"
    # 60 prompt + 20 generated tokens in blocks of 8 kept to 16 tokens + one block: at least 6 blocks given back.
    # The stats snapshot follows the answer from the engine process: polled, not read at the same instant.
    assert wait_for(lambda: evicted_blocks(h2o_server.url) >= 6, timeout=30)
    usage_zero = re.compile(r"^conveyor:kv_cache_usage_perc\{[^}]*\} 0\.0$", re.M)
    assert wait_for(lambda: usage_zero.search(httpx.get(h2o_server.url + "/metrics").text), timeout=30), \
        "every block back in the pool"


@pytest.mark.parametrize("budget", [0, -3, 2.5, "many"])
def test_a_bad_budget_is_a_400_naming_the_field(h2o_server, budget):
    resp = httpx.post(h2o_server.url + "/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 4, "kv_budget_tokens": budget})
    assert resp.status_code == 400, resp.text
    assert "kv_budget_tokens" in resp.json()["error"]["message"]
    ok = httpx.post(h2o_server.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_budget_without_an_eviction_policy_is_refused(tiny_llama_dir, tmp_path):
    served = serve(tiny_llama_dir, tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                      extra_body={"kv_budget_tokens": 16})
        assert "kv_budget_tokens" in info.value.message and "--kv-eviction" in info.value.message
        assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4).usage.completion_tokens >= 1
        assert "kv_evicted_blocks" not in httpx.get(served.url + "/metrics").text  # no policy: no counter
    finally:
        served.stop(timeout_s=30)
