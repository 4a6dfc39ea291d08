"""``/v1/completions`` echo and vLLM's prompt_logprobs on a tiny model over real HTTP: shapes, n > 1, streaming,
and the refusals (the numbers against transformers are in test_smollm2_server.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from tests.helpers.server import serve_model

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"

PROMPT = "w10 w11 w12 w13 w14"


@pytest.fixture(scope="module")
def url(tiny_llama_dir):
    with serve_model(tiny_llama_dir) as (base, _):
        yield base + "/v1/completions"


def post(url, **body):
    return httpx.post(url, json={"prompt": PROMPT, "temperature": 0, **body}, timeout=60)


def test_echo_text_and_logprobs_for_every_choice(url):
    body = post(url, echo=True, logprobs=2, max_tokens=3, n=2, ignore_eos=True).json()
    plain = post(url, max_tokens=3, ignore_eos=True).json()["choices"][0]["text"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        assert choice["text"] == PROMPT + plain
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == 5 + 3  # 5 words (this tokenizer adds no BOS), then the completion
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
        assert all(len(top) in (2, 3) for top in lp["top_logprobs"][1:])  # the top 2, plus the token itself
        assert lp["text_offset"] == sorted(lp["text_offset"])
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 6


def test_echo_alone_and_max_tokens_zero(url):
    assert post(url, echo=True, max_tokens=2).json()["choices"][0]["logprobs"] is None
    scored = post(url, echo=True, max_tokens=0, logprobs=0).json()
    (choice,) = scored["choices"]
    assert choice["text"] == PROMPT and len(choice["logprobs"]["tokens"]) == 5
    assert scored["usage"]["completion_tokens"] == 0
    refused = post(url, max_tokens=0)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_field_and_refusal(url):
    choice = post(url, prompt=[[1, 14, 15, 16], [1, 20]], max_tokens=1, prompt_logprobs=1).json()["choices"]
    assert [len(c["prompt_logprobs"]) for c in choice] == [4, 2] and choice[0]["prompt_logprobs"][0] is None
    entry = choice[0]["prompt_logprobs"][1]
    assert "14" in entry and entry["14"]["rank"] >= 1 and "decoded_token" in entry["14"]
    assert any(e["rank"] == 1 for e in entry.values())
    assert choice[0]["logprobs"] is None and not choice[0]["text"].startswith("w14 w15 w16")  # no echo asked
    refused = post(url, prompt_logprobs=21)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_streamed_echo_comes_first(url):
    body = {"prompt": PROMPT, "temperature": 0, "echo": True, "logprobs": 1, "max_tokens": 4, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["text"].startswith(PROMPT) and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == post(url, echo=True, max_tokens=4, ignore_eos=True).json()[
        "choices"][0]["text"]
    offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and len(offsets) == 5 + 4
