"""Parts of the OpenAI surface that clients send (issue #25 item 4): ``GET /v1/models/{id}``, CORS, chat's
``continue_final_message`` / ``add_generation_prompt`` / ``echo``, and ``stream_options.continuous_usage_stats``,
over real HTTP (uvicorn on 127.0.0.1) with the official ``openai`` client.

Two servers: the tiny Llama with its one-line template, served under a name with a slash (as HF names are), and
the embedded random-weights model, whose byte tokenizer and built-in ``DEFAULT_CHAT_TEMPLATE`` make every prompt
token one byte of the rendered text, so token counts say exactly what the template rendered.
"""

from __future__ import annotations

import argparse
import gzip
import json

import httpx
import openai
import pytest

from conveyor.models import EMBEDDED_NAME
from conveyor.server.app import build_app
from conveyor.server.cors import CORSConfig
from tests.helpers.server import make_engine, running_server, serve_model

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"

TINY = "org/tiny"  # a slash, as in "HuggingFaceTB/SmolLM2-135M-Instruct": the route must take it


@pytest.fixture(scope="module")
def tiny(tiny_chat_dir):
    with serve_model(tiny_chat_dir, served_model_name=TINY) as (url, _):
        yield url


@pytest.fixture(scope="module")
def tiny_client(tiny):
    return openai.OpenAI(base_url=tiny + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def embedded():
    with serve_model(EMBEDDED_NAME, served_model_name="embedded", dtype="float32", num_kv_blocks=64,
                     max_model_len=1024) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(embedded):
    return openai.OpenAI(base_url=embedded + "/v1", api_key="none", max_retries=0)


# ---- GET /v1/models/{model} -------------------------------------------------------------------------------
def test_retrieve_a_model_returns_the_card_models_lists(tiny, tiny_client):
    (listed,) = tiny_client.models.list().data
    card = tiny_client.models.retrieve(TINY)  # sent as /v1/models/org%2Ftiny
    assert card.id == TINY and card.object == "model"
    assert card.model_dump() == listed.model_dump()  # the same object, max_model_len and all
    assert httpx.get(f"{tiny}/v1/models/{TINY}").json() == httpx.get(tiny + "/v1/models").json()["data"][0]


def test_retrieve_an_unknown_model_is_404_in_openai_shape(tiny, tiny_client):
    with pytest.raises(openai.NotFoundError) as info:
        tiny_client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found" and "gpt-4o" in info.value.message
    for name in ("org", "org/tiny/extra", "ORG/TINY"):  # a prefix, a longer path, another case: not the model
        resp = httpx.get(f"{tiny}/v1/models/{name}")
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", name


# ---- CORS ------------------------------------------------------------------------------------------------
UI = "https://ui.example"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "w21 w22"}]


def preflight(url: str, origin: str = UI, method: str = "POST", headers: str = "authorization, content-type"):
    return httpx.options(url + CHAT, headers={"Origin": origin, "Access-Control-Request-Method": method,
                                              "Access-Control-Request-Headers": headers})


def test_default_cors_answers_a_browser_preflight_and_marks_every_answer(tiny):
    """vLLM's defaults: any origin, method and header, no credentials."""
    resp = preflight(tiny)
    assert resp.status_code == 200, resp.text
    h = resp.headers
    assert h["access-control-allow-origin"] == "*" and "POST" in h["access-control-allow-methods"]
    assert h["access-control-allow-headers"] == "authorization, content-type"  # "*": what was asked, mirrored
    assert "access-control-allow-credentials" not in h
    body = {"model": TINY, "messages": MSG, "max_tokens": 2}
    ok = httpx.post(tiny + CHAT, json=body, headers={"Origin": UI})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
    # errors from the handlers carry the header too, so the page can read them
    bad = httpx.post(tiny + CHAT, json={**body, "temperature": -1}, headers={"Origin": UI})
    assert bad.status_code == 400 and bad.headers["access-control-allow-origin"] == "*"
    lost = httpx.get(tiny + "/v1/nowhere", headers={"Origin": UI})
    assert lost.status_code == 404 and lost.headers["access-control-allow-origin"] == "*"
    # a client that is no browser sends no Origin: its answers go out as before
    assert "access-control-allow-origin" not in httpx.post(tiny + CHAT, json=body).headers


@pytest.fixture(scope="module")
def guarded(tiny_chat_dir):
    """One allowed origin with credentials, an API key and a small body cap: CORS must compose with both."""
    cors = CORSConfig(allowed_origins=(UI,), allowed_methods=("GET", "POST"),
                      allowed_headers=("authorization", "content-type"), allow_credentials=True)
    app = build_app(make_engine(tiny_chat_dir), "tiny", "sekret", log_stats_interval_s=0.0, shutdown_timeout_s=2.0,
                    max_request_body_bytes=2000, cors=cors)
    with running_server(app) as url:
        yield url


def test_configured_cors_allows_only_its_origin_methods_and_headers(guarded):
    resp = preflight(guarded)  # a preflight carries no API key: it must not be 401
    assert resp.status_code == 200, resp.text
    assert resp.headers["access-control-allow-origin"] == UI and resp.headers["access-control-allow-credentials"] == "true"
    for refused in (preflight(guarded, origin="https://evil.example"), preflight(guarded, method="DELETE"),
                    preflight(guarded, headers="x-secret")):
        assert refused.status_code == 400 and refused.text.startswith("Disallowed CORS")
    assert preflight(guarded, origin="https://evil.example").headers.get("access-control-allow-origin") != \
        "https://evil.example"
    simple = httpx.get(guarded + "/health", headers={"Origin": "https://evil.example"})
    assert simple.status_code == 200 and "access-control-allow-origin" not in simple.headers


def test_cors_headers_are_on_the_api_key_and_body_limit_answers(guarded):
    key = {"Authorization": "Bearer sekret", "Origin": UI}
    body = {"messages": MSG, "max_tokens": 2}
    unauthorized = httpx.post(guarded + CHAT, json=body, headers={"Origin": UI})
    assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == UI
    assert unauthorized.json()["error"]["code"] == "invalid_api_key"
    too_big = httpx.post(guarded + CHAT, json={**body, "messages": [{"role": "user", "content": "w1 " * 1000}]},
                         headers=key)
    assert too_big.status_code == 413 and too_big.headers["access-control-allow-origin"] == UI

    def chunked():  # no Content-Length: the cap is crossed while the app reads, and the error handler answers
        yield b'{"messages": [{"role": "user", "content": "'
        yield b"w1 " * 1000
        yield b'"}]}'

    crossed = httpx.post(guarded + CHAT, content=chunked(), headers={**key, "Content-Type": "application/json"})
    assert crossed.status_code == 413 and crossed.headers["access-control-allow-origin"] == UI
    zipped = httpx.post(guarded + CHAT, content=gzip.compress(json.dumps(body).encode()),
                        headers={**key, "Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert zipped.status_code == 415 and zipped.headers["access-control-allow-origin"] == UI
    with httpx.stream("POST", guarded + CHAT, json={**body, "stream": True}, headers=key) as stream:
        assert stream.status_code == 200 and stream.headers["access-control-allow-origin"] == UI
        assert stream.headers["access-control-allow-credentials"] == "true"
        assert stream.read().decode().rstrip().endswith("data: [DONE]")


def test_cors_flags_parse_as_vllm_names_them():
    from conveyor.serve import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert CORSConfig.from_namespace(parser.parse_args(["serve"])) == CORSConfig(("*",), ("*",), ("*",), False)
    ns = parser.parse_args(["serve", "--allowed-origins", '["https://a.example", "https://b.example"]',
                            "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["authorization"]',
                            "--allow-credentials"])
    assert CORSConfig.from_namespace(ns) == CORSConfig(("https://a.example", "https://b.example"), ("GET", "POST"),
                                                       ("authorization",), True)
    for bad in ("https://a.example", '"*"', '[1, 2]', "[nope"):  # not a JSON list of strings: refused at startup
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--allowed-origins", bad])


# ---- chat: continue_final_message and add_generation_prompt -------------------------------------------------
# DEFAULT_CHAT_TEMPLATE renders each message as "<|role|>\ncontent</s>\n" after "<s>" (the byte tokenizer encodes
# all of it byte by byte: one token per byte), and the generation prompt as "<|assistant|>\n".
CONV = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a time"}]
CLOSED = "<s><|user|>\nTell me a story.</s>\n<|assistant|>\nOnce upon a time</s>\n"
OPEN = "<s><|user|>\nTell me a story.</s>\n<|assistant|>\nOnce upon a time"
GREEDY = {"temperature": 0, "max_tokens": 6}


def rendered(url: str, **body) -> str:
    """What the template made of ``body`` (/tokenize, then /detokenize: bytes in, bytes out)."""
    tokens = httpx.post(url + "/tokenize", json={"model": "embedded", **body}).json()["tokens"]
    return httpx.post(url + "/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_tokenize_renders_the_final_message_open_or_closed(embedded):
    assert rendered(embedded, messages=CONV, continue_final_message=True) == OPEN
    assert rendered(embedded, messages=CONV, continue_final_message=True, add_generation_prompt=False) == OPEN
    assert rendered(embedded, messages=CONV, add_generation_prompt=False) == CLOSED
    assert rendered(embedded, messages=CONV) == CLOSED + "<|assistant|>\n"


def test_continue_final_message_continues_the_prefilled_answer(client):
    reply = client.chat.completions.create(model="embedded", messages=CONV, **GREEDY,
                                           extra_body={"continue_final_message": True, "ignore_eos": True})
    assert reply.usage.prompt_tokens == len(OPEN.encode())  # no "</s>\n" after the final message, no new header
    # what the model does with exactly that text, given as a plain prompt
    same = client.completions.create(model="embedded", prompt=OPEN, **GREEDY,
                                     extra_body={"add_special_tokens": False, "ignore_eos": True})
    (choice,) = reply.choices
    assert choice.message.content == same.choices[0].text and choice.message.role == "assistant"
    assert reply.usage.completion_tokens == 6


def test_add_generation_prompt_false_is_honoured_and_the_role_is_the_final_messages(client):
    question = CONV[:1]
    reply = client.chat.completions.create(model="embedded", messages=question, **GREEDY,
                                           extra_body={"add_generation_prompt": False, "ignore_eos": True})
    assert reply.usage.prompt_tokens == len("<s><|user|>\nTell me a story.</s>\n")
    assert reply.choices[0].message.role == "user"  # vLLM: no new message was started, so it is the user's
    chunks = list(client.chat.completions.create(model="embedded", messages=question, **GREEDY, stream=True,
                                                 extra_body={"add_generation_prompt": False, "ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "user"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_continue_final_message_with_add_generation_prompt_is_400(embedded, path):
    body = {"model": "embedded", "messages": CONV, "continue_final_message": True, "add_generation_prompt": True,
            "max_tokens": 2}
    resp = httpx.post(embedded + path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["message"] == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    assert error["param"] == "continue_final_message"
    # A flag is a JSON bool: "true" is not read as one (server/fields.py), whatever the other flag says.
    resp = httpx.post(embedded + path, json={**body, "add_generation_prompt": "true"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "add_generation_prompt", resp.text


def test_continue_final_message_without_text_to_continue_is_400(client, embedded):
    for last in ({"role": "assistant", "content": ""}, {"role": "assistant", "content": "   "},
                 {"role": "assistant", "content": [{"type": "text", "text": ""}]}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="embedded", messages=[CONV[0], last], max_tokens=2,
                                           extra_body={"continue_final_message": True})
        assert info.value.param == "continue_final_message" and "text to continue" in info.value.message
    resp = httpx.post(embedded + "/tokenize", json={"messages": [{"role": "assistant", "content": ""}],
                                                    "continue_final_message": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "continue_final_message"
    bad = httpx.post(embedded + CHAT, json={"messages": CONV, "continue_final_message": "sometimes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"
    assert httpx.get(embedded + "/health").status_code == 200


# ---- chat: echo (vLLM's) ------------------------------------------------------------------------------------
def chat(client, messages, **extra):
    return client.chat.completions.create(model="embedded", messages=messages, **GREEDY,
                                          extra_body={"ignore_eos": True, **extra})


def test_echo_puts_the_continued_message_in_front_of_the_reply(client):
    plain = chat(client, CONV, continue_final_message=True).choices[0].message.content
    echoed = chat(client, CONV, continue_final_message=True, echo=True)
    assert echoed.choices[0].message.content == "Once upon a time" + plain
    assert echoed.usage.completion_tokens == 6  # the echo is not generated
    stream = client.chat.completions.create(model="embedded", messages=CONV, **GREEDY, stream=True,
                                            extra_body={"ignore_eos": True, "continue_final_message": True,
                                                        "echo": True})
    chunks = [c.choices[0] for c in stream]
    assert chunks[0].delta.role == "assistant" and chunks[0].delta.content == ""
    assert chunks[1].delta.content == "Once upon a time" and chunks[1].finish_reason is None  # its own chunk
    assert "".join(c.delta.content or "" for c in chunks) == echoed.choices[0].message.content


def test_echo_for_every_choice_streamed_and_not(embedded):
    body = {"messages": CONV, "continue_final_message": True, "echo": True, "n": 2, "seed": 7,
            "temperature": 1.0, "max_tokens": 4, "ignore_eos": True}
    choices = httpx.post(embedded + CHAT, json=body, timeout=120).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["message"]["content"].startswith("Once upon a time") for c in choices)
    with httpx.stream("POST", embedded + CHAT, json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    echoes = [e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("content") == "Once upon a time"]
    assert echoes == [0, 1]
    texts = {0: "", 1: ""}
    for e in events:
        texts[e["choices"][0]["index"]] += e["choices"][0]["delta"].get("content") or ""
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in choices]  # seeded: the same completions


def test_echo_only_when_the_final_message_is_in_the_replys_role(client):
    question = CONV[:1]
    # a new assistant message after the user's: nothing of the user's words is echoed (vLLM's rule)
    assert chat(client, question, echo=True).choices[0].message.content == chat(client, question).choices[
        0].message.content
    # a new assistant message after an assistant's (a generation prompt, no continue): vLLM echoes that one
    after = chat(client, CONV, echo=True).choices[0].message.content
    assert after == "Once upon a time" + chat(client, CONV).choices[0].message.content
    # no generation prompt: the reply goes on as the user's message, which is echoed
    own = chat(client, question, add_generation_prompt=False, echo=True).choices[0]
    assert own.message.role == "user" and own.message.content == "Tell me a story." + chat(
        client, question, add_generation_prompt=False).choices[0].message.content


def test_echo_that_is_no_bool_is_400(embedded):
    resp = httpx.post(embedded + CHAT, json={"messages": CONV, "echo": "loudly"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "echo"
    assert resp.json()["error"]["message"].startswith("echo: Input should be a valid boolean")  # a value check


# ---- stream_options.continuous_usage_stats ------------------------------------------------------------------
PROMPT = "w10 w11 w12 w13 w14"  # 5 tokens of the tiny model's word tokenizer


def events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_completions_stream_usage_on_every_chunk_per_choice(tiny):
    body = {"model": TINY, "prompt": [PROMPT, "w7 w8"], "n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 1,
            "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = events(tiny, "/v1/completions", body)
    *with_choices, last = chunks
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 7, "completion_tokens": 20,
                                                       "total_tokens": 27}  # each prompt once, as before
    seen: dict[int, list[int]] = {}
    for chunk in with_choices:
        (choice,) = chunk["choices"]
        u = chunk["usage"]
        assert u["prompt_tokens"] == (5 if choice["index"] < 2 else 2)  # choices 0-1: prompt 0; 2-3: prompt 1
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        seen.setdefault(choice["index"], []).append(u["completion_tokens"])
    assert sorted(seen) == [0, 1, 2, 3]
    for counts in seen.values():  # the choice's own tokens so far, up to its 5
        assert counts == sorted(counts) and counts[-1] == 5 and counts[0] >= 1


def assert_not_a_bool_is_400(url: str, path: str, body: dict) -> None:
    resp = httpx.post(url + path, json={**body, "stream": True, "stream_options": {"continuous_usage_stats": "always"}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream_options"
    assert "continuous_usage_stats" in resp.json()["error"]["message"]


def test_continuous_usage_without_include_usage_and_for_a_scored_prompt(tiny):
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True,
            "stream_options": {"continuous_usage_stats": True}}
    chunks = events(tiny, "/v1/completions", body)
    assert all(c["choices"] for c in chunks)  # no last usage chunk: include_usage was not asked for
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    scored = events(tiny, "/v1/completions", {**body, "echo": True, "max_tokens": 0})
    assert {c["usage"]["completion_tokens"] for c in scored} == {0}  # echo + max_tokens 0 generates nothing
    plain = events(tiny, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain if c["choices"])  # as before: only the last chunk counts
    assert_not_a_bool_is_400(tiny, "/v1/completions", body)


def test_chat_stream_usage_on_every_chunk(client, embedded):
    stream = client.chat.completions.create(
        model="embedded", messages=CONV, **GREEDY, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"continue_final_message": True, "echo": True, "ignore_eos": True})
    chunks = list(stream)
    prompt = len(OPEN.encode())
    *with_choices, last = chunks
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt, 6)
    role, echo, *generated = with_choices
    for chunk in (role, echo):  # sent before anything was generated
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens) == (
            prompt, 0, prompt)
    counts = [c.usage.completion_tokens for c in generated]
    assert all(c.usage.prompt_tokens == prompt for c in generated) and counts == sorted(counts)
    assert counts[-1] == 6 and generated[-1].choices[0].finish_reason == "length"
    assert_not_a_bool_is_400(embedded, CHAT, {"messages": CONV[:1], "max_tokens": 2})
