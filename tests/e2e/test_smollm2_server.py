"""The default model served over HTTP, as a new user meets it: chat completions through the model's template that
stop at its end-of-turn token, and ``conveyor chat --url`` keeping a conversation. The server runs on the
session's SmolLM2 engine and stops when this module ends."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

from conveyor.server.app import build_app
from tests.helpers.server import running_server

pytestmark = pytest.mark.slow  # the real default model (SmolLM2-135M-Instruct): run by CI, skipped by -m "not slow"


@pytest.fixture(scope="module")
def smollm2_url(smollm2_llm):
    app = build_app(smollm2_llm.engine, None, None, log_stats_interval_s=0.0, shutdown_timeout_s=2.0)
    with running_server(app) as url:
        yield url


def test_chat_completion_uses_template_and_stops_at_end_of_turn(smollm2_url):
    client = openai.OpenAI(base_url=smollm2_url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=64,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.message.content == "The capital of France is Paris." and choice.finish_reason == "stop"
    assert reply.usage.completion_tokens == 8  # 7 text tokens, then <|im_end|>, which is not shown
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=question, max_tokens=64, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == choice.message.content


def test_conveyor_chat_cli_keeps_the_conversation(smollm2_url):
    turns = "What is the capital of France?\nAnd of Germany?\n/reset\nHi\n/exit\n"
    done = subprocess.run([sys.executable, "-m", "conveyor", "chat", "--url", smollm2_url, "--max-tokens", "40"],
                          input=turns, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "Paris" in lines[0] and "Berlin" in lines[1]  # "And of Germany?" only makes sense with the history
    assert len(lines) >= 3


def test_conveyor_chat_cli_reports_an_unreachable_server():
    done = subprocess.run([sys.executable, "-m", "conveyor", "chat", "--url", "http://127.0.0.1:9"],
                          input="hi\n", capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "cannot reach http://127.0.0.1:9" in done.stderr


TEXT = "The capital of France is Paris. The capital of Germany is Berlin, and the capital of Italy is Rome."


def test_echo_prompt_logprobs_equal_transformers(smollm2_url, smollm2_llm, smollm2_hf):
    """What lm-eval's local-completions loglikelihood sends: token-id prompts, echo, logprobs 1, max_tokens 1."""
    import torch

    ids = smollm2_llm.tokenizer.encode(TEXT)
    with torch.no_grad():
        ref = torch.log_softmax(smollm2_hf(torch.tensor([ids])).logits[0].double(), dim=-1)
    want = [None] + [ref[i - 1, t].item() for i, t in enumerate(ids) if i > 0]
    body = {"model": "SmolLM2-135M-Instruct", "prompt": [ids, ids[:10]], "max_tokens": 1, "logprobs": 1,
            "echo": True, "temperature": 0}
    resp = httpx.post(smollm2_url + "/v1/completions", json=body, timeout=120).json()
    full, short = resp["choices"]
    lp = full["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][0] is None and want[0] is None
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:len(ids)], want[1:])) < 1e-4
    assert full["text"].startswith(TEXT) and len(full["text"]) > len(TEXT)
    # lm-eval's greedy check: the prompt token is in its top_logprobs, and is the max there when it is the argmax
    for i, (token_lp, top) in enumerate(zip(lp["token_logprobs"][1:len(ids)], lp["top_logprobs"][1:len(ids)]), 1):
        assert token_lp in top.values()
        assert (token_lp == max(top.values())) == (ref[i - 1].argmax().item() == ids[i])
    assert short["logprobs"]["token_logprobs"][1:10] == pytest.approx(lp["token_logprobs"][1:10], abs=1e-4)
    assert resp["usage"]["prompt_tokens"] == len(ids) + 10


def test_echo_without_generation_and_vllm_prompt_logprobs(smollm2_url, smollm2_llm):
    ids = smollm2_llm.tokenizer.encode(TEXT)
    body = {"model": "SmolLM2-135M-Instruct", "prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 0,
            "prompt_logprobs": 2}
    resp = httpx.post(smollm2_url + "/v1/completions", json=body, timeout=120).json()
    (choice,) = resp["choices"]
    assert choice["text"] == TEXT and resp["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == len(ids)  # the prompt only
    assert "".join(choice["logprobs"]["tokens"]) == TEXT and choice["logprobs"]["text_offset"][1] == len(
        choice["logprobs"]["tokens"][0])
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i, entry in enumerate(plp[1:], 1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(choice["logprobs"]["token_logprobs"][i], abs=1e-6)
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked][:2] == [1, 2] and ranked[0]["logprob"] >= ranked[-1]["logprob"]
    # streamed, the echo comes first, with the prompt's logprobs
    with httpx.stream("POST", smollm2_url + "/v1/completions", json={**body, "max_tokens": 3, "stream": True,
                                                                     "ignore_eos": True}, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(TEXT) and first["logprobs"]["token_logprobs"][0] is None
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == len(ids) + 3


def test_continue_final_message_and_echo_on_the_models_own_template(smollm2_url):
    """A prefilled answer through SmolLM2's ChatML template: left open, the model finishes the sentence; echo puts
    the prefill in front, as vLLM answers."""
    client = openai.OpenAI(base_url=smollm2_url + "/v1", api_key="none")
    conv = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    kw = dict(model="SmolLM2-135M-Instruct", messages=conv, max_tokens=16, temperature=0)
    reply = client.chat.completions.create(**kw, extra_body={"continue_final_message": True, "echo": True})
    (choice,) = reply.choices
    assert choice.message.content == "The capital of France is Paris." and choice.finish_reason == "stop"
    closed = httpx.post(smollm2_url + "/tokenize", json={"messages": conv, "add_generation_prompt": False}).json()
    assert reply.usage.prompt_tokens == closed["count"] - 2  # without the final "<|im_end|>" and "\n"
    stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True,
                                                                               "continuous_usage_stats": True},
                                            extra_body={"continue_final_message": True, "echo": True})
    chunks = [c for c in stream if c.choices]
    assert chunks[1].choices[0].delta.content == "The capital of France is"  # the echo, before any token
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_json_mode_through_langchain_instructor_and_the_sdk_on_the_real_model(smollm2_url):
    """JSON mode (response_format json_object), which a random-weights model cannot end: LangChain's
    ``with_structured_output(method="json_mode")``, instructor's ``Mode.JSON`` and the SDK's ``parse``."""
    import instructor
    import openai
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    ask = "Give me a JSON object with the keys name and age for a person called Ada who is 36."
    llm = ChatOpenAI(base_url=smollm2_url + "/v1", api_key="none", model="SmolLM2-135M-Instruct", max_tokens=100, temperature=0,
                     max_retries=0)
    person = llm.with_structured_output(Person, method="json_mode").invoke(ask)
    assert isinstance(person, Person) and person.age == 36
    client = openai.OpenAI(base_url=smollm2_url + "/v1", api_key="none", max_retries=0)
    patched = instructor.from_openai(client, mode=instructor.Mode.JSON)
    person = patched.chat.completions.create(model="SmolLM2-135M-Instruct", response_model=Person, max_tokens=100, temperature=0,
                                             messages=[{"role": "user", "content": ask}], max_retries=0)
    assert isinstance(person, Person) and person.age == 36
    parsed = client.chat.completions.parse(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": ask}],
                                           response_format=Person, max_tokens=100, temperature=0)
    assert parsed.choices[0].message.parsed.age == 36
