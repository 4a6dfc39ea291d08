"""Reasoning kept apart from the answer through a real server: a scripted model (tests/helpers/scripted.py) whose
Qwen3-shaped template opens ``<think>`` and which writes ``ok</think>`` then ``Paris``. Chat completions carry the
reasoning as ``reasoning_content``, never inside the answer, streamed or not (the other protocols' own forms are
checked in test_api_anthropic.py, test_api_responses.py and test_api_ollama.py); with thinking switched off the
template writes an empty block and the answer is all there is; a constraint applies to the answer after the
reasoning; with reasoning off (``--reasoning-parser none``) the reply is the text as before."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers.scripted import serve_scripted

pytestmark = pytest.mark.slow  # a real server

MSG = [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serve_scripted(tmp_path_factory.mktemp("scripted")) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_chat_completions_carry_reasoning_content_apart_from_the_answer(client):
    reply = client.chat.completions.create(model="scripted", messages=MSG, max_tokens=20, temperature=0)
    message = reply.choices[0].message
    assert (message.content, message.reasoning_content, reply.choices[0].finish_reason) == ("Paris", "ok", "stop")
    chunks = list(client.chat.completions.create(model="scripted", messages=MSG, max_tokens=20, temperature=0,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (content, reasoning) == ("Paris", "ok")
    # the reasoning streams first, in deltas of its own, then the answer (how many deltas each depends on how
    # many tokens the engine made while the API process was busy: on a loaded machine one delta can hold them all)
    kinds = [k for d in deltas for k in ("reasoning", "content")
             if (getattr(d, "reasoning_content", None) if k == "reasoning" else d.content)]
    assert kinds == sorted(kinds, key=("reasoning", "content").index) and "reasoning" in kinds and "content" in kinds


def test_thinking_switched_off_through_chat_template_kwargs(client):
    reply = client.chat.completions.create(model="scripted", messages=MSG, max_tokens=20, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert message.content == "Paris" and not getattr(message, "reasoning_content", None)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="scripted", messages=MSG, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    assert info.value.param == "chat_template_kwargs"


def test_a_constraint_applies_to_the_answer_after_the_reasoning(client):
    reply = client.chat.completions.create(model="scripted", messages=MSG, max_tokens=20, temperature=0,
                                           extra_body={"structured_outputs": {"choice": ["no", "yes"]}})
    message = reply.choices[0].message
    # the script's reasoning is free; its answer ("Paris") is not one of the choices, so the grammar picks one
    assert message.reasoning_content == "ok" and message.content in ("no", "yes")


def test_tokenizer_info_as_vllm_serves_it(url):
    info = httpx.get(url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert "enable_thinking" in info["chat_template"] and info["model_max_length"] == 1024
    ids = httpx.post(url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert ids["tokens"] == [info["eos_token_id"]]  # what lm-eval's RemoteTokenizer does with it


def test_with_reasoning_off_the_reply_is_the_text_as_before(tmp_path):
    """--reasoning-parser none: nothing is split, the reply is the model's text as it was before reasoning was
    read at all, and the message has no reasoning_content."""
    with serve_scripted(tmp_path, reasoning_parser="none") as base:
        reply = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "scripted", "messages": MSG, "max_tokens": 20, "temperature": 0}).json()
    message = reply["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "ok</think>\nParis"}
