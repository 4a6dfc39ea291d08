"""The reliability suite: bad input, slow clients, failures inside the engine (fuzzing from the OpenAPI schema:
tests/server/test_fuzz.py).

Every case runs against a real uvicorn on 127.0.0.1. After each bad-input case the server must still be healthy
and serve an ordinary request: a case that breaks the engine shows up even when its own answer looks fine.
The cases reproduce the reliability probe of 2026-11-30 (``docs/reliability.md``) and the stop, batch and
unsupported-field cases of the second probe (2026-12-01) on the tiny test model (vocabulary 384, context 512);
``tests/server/test_edge_bounds.py`` covers those bounds in full.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from conveyor.server.app import build_app
from tests.helpers.checkpoints import TINY_VOCAB
from tests.helpers.server import make_engine, running_server, serve_model

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"

C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
MSG = [{"role": "user", "content": "w5 w6"}]
ONE_MB = " ".join(["w9"] * 350_000)  # ~1 MB of text, 350k tokens


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    with serve_model(tiny_chat_dir) as (url, app):
        yield SimpleNamespace(url=url, app=app)


def raw(text: str) -> bytes:
    return text.encode()


def c(**fields) -> dict:
    return {"prompt": "w1 w2", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"messages": MSG, "max_tokens": 2, **fields}


# (name, method, path, body: dict / list / bytes / None, expected status, expected `param` (400/404 only))
CASES = [
    # -- the body itself
    ("malformed JSON", "POST", C, b"{not json", 400, None),
    ("malformed JSON chat", "POST", CHAT, b'{"messages": [', 400, None),
    ("body is a JSON list", "POST", C, [1, 2], 400, None),
    ("empty body", "POST", C, b"", 400, None),
    ("non-UTF-8 body", "POST", C, b'{"prompt": "\xff\xfe"}', 400, None),
    ("a 5000-digit integer", "POST", C, raw('{"prompt": "w1", "max_tokens": ' + "9" * 5000 + "}"), 400, None),
    ("JSON nested 100000 deep", "POST", C, b"[" * 100_000 + b"]" * 100_000, 400, None),
    # -- max_tokens / min_tokens
    ("max_tokens 'abc'", "POST", C, c(max_tokens="abc"), 400, "max_tokens"),
    ("max_tokens -1", "POST", C, c(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens 0", "POST", C, c(max_tokens=0), 400, "max_tokens"),
    ("max_tokens 10**12", "POST", C, c(max_tokens=10**12), 400, "prompt"),
    ("max_tokens 2**70", "POST", C, c(max_tokens=2**70), 400, "max_tokens"),
    ("max_tokens 1e20 (float)", "POST", C, c(max_tokens=1e20), 400, "max_tokens"),
    ("max_tokens 1.5", "POST", C, c(max_tokens=1.5), 400, "max_tokens"),
    ("max_tokens true (a bool is not a number)", "POST", C, c(max_tokens=True), 400, "max_tokens"),
    ("max_tokens 2.0 (an integer field takes no float)", "POST", C, c(max_tokens=2.0), 400, "max_tokens"),
    ("chat max_tokens -1", "POST", CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    ("chat max_completion_tokens 10**12", "POST", CHAT, chat(max_completion_tokens=10**12), 400, "prompt"),
    ("min_tokens > max_tokens", "POST", C, c(min_tokens=10), 400, "min_tokens"),
    ("min_tokens -1", "POST", C, c(min_tokens=-1), 400, "min_tokens"),
    ("chat min_tokens 10**9, no max_tokens", "POST", CHAT, {"messages": MSG, "min_tokens": 10**9}, 400,
     "min_tokens"),
    ("completions min_tokens beyond the context", "POST", C, c(max_tokens=None, min_tokens=511), 400, "min_tokens"),
    # -- floats: finite, in range
    ("temperature -1", "POST", C, c(temperature=-1), 400, "temperature"),
    ("temperature NaN (raw JSON)", "POST", C, raw('{"prompt": "w1", "max_tokens": 2, "temperature": NaN}'), 400,
     "temperature"),
    ("temperature Infinity (raw JSON)", "POST", C,
     raw('{"prompt": "w1", "max_tokens": 2, "temperature": Infinity}'), 400, "temperature"),
    ("temperature 'inf'", "POST", C, c(temperature="inf"), 400, "temperature"),
    ("temperature 'nan'", "POST", C, c(temperature="nan"), 400, "temperature"),
    ("chat temperature 'nan'", "POST", CHAT, chat(temperature="nan"), 400, "temperature"),
    ("temperature 1e308 (beyond float32)", "POST", C, c(temperature=1e308), 400, "temperature"),
    ("temperature 1e30", "POST", C, c(temperature=1e30), 200, None),
    ("temperature true (a bool is not a number)", "POST", C, c(temperature=True), 400, "temperature"),
    ("temperature 10**400 (an integer past float)", "POST", C, c(temperature=10**400), 400, "temperature"),
    ("temperature 1e-300 (raised to 0.01)", "POST", C, c(temperature=1e-300), 200, None),
    ("top_p 0", "POST", C, c(top_p=0), 400, "top_p"),
    ("top_p 2", "POST", C, c(top_p=2), 400, "top_p"),
    ("top_p 'nan'", "POST", C, c(top_p="nan"), 400, "top_p"),
    ("top_p 1e-300", "POST", C, c(top_p=1e-300), 200, None),
    ("min_p 'nan'", "POST", C, c(min_p="nan"), 400, "min_p"),
    ("min_p 2", "POST", C, c(min_p=2), 400, "min_p"),
    ("repetition_penalty 'nan'", "POST", C, c(repetition_penalty="nan"), 400, "repetition_penalty"),
    ("repetition_penalty 'inf'", "POST", C, c(repetition_penalty="inf"), 400, "repetition_penalty"),
    ("repetition_penalty 0.001", "POST", C, c(repetition_penalty=0.001), 400, "repetition_penalty"),
    ("repetition_penalty 1e30", "POST", C, c(repetition_penalty=1e30), 200, None),
    ("presence_penalty 5", "POST", C, c(presence_penalty=5), 400, "presence_penalty"),
    ("frequency_penalty 'nan'", "POST", C, c(frequency_penalty="nan"), 400, "frequency_penalty"),
    # -- integers the sampler, the generators and the KV cache must hold
    ("top_k 10**9", "POST", C, c(top_k=10**9), 200, None),
    ("top_k 2**63-1", "POST", C, c(top_k=2**63 - 1), 200, None),
    ("top_k 2**70", "POST", C, c(top_k=2**70), 400, "top_k"),
    ("chat top_k 10**30", "POST", CHAT, chat(top_k=10**30), 400, "top_k"),
    ("top_k true", "POST", C, c(top_k=True), 400, "top_k"),
    ("top_k -2", "POST", C, c(top_k=-2), 400, "top_k"),
    ("n 0", "POST", C, c(n=0), 400, "n"),
    ("n -1", "POST", C, c(n=-1), 400, "n"),
    ("n 1000 (over --max-n)", "POST", C, c(n=1000), 400, "n"),
    ("n 2**70", "POST", C, c(n=2**70), 400, "n"),
    ("chat n 129", "POST", CHAT, chat(n=129), 400, "n"),
    ("n 128, max_tokens 1", "POST", C, c(n=128, max_tokens=1), 200, None),
    ("n '2' (a string is not a number)", "POST", C, c(n="2"), 400, "n"),
    ("n true", "POST", C, c(n=True), 400, "n"),
    ("seed -5", "POST", C, c(seed=-5), 200, None),
    ("seed 2**64-1", "POST", C, c(seed=2**64 - 1), 200, None),
    ("seed 2**64-1, n=3 (derived seeds wrap)", "POST", C, c(seed=2**64 - 1, n=3), 200, None),
    ("seed -2**63", "POST", C, c(seed=-(2**63)), 200, None),
    ("seed 2**64", "POST", C, c(seed=2**64), 400, "seed"),
    ("chat seed 10**30", "POST", CHAT, chat(seed=10**30), 400, "seed"),
    ("seed -2**63-1", "POST", C, c(seed=-(2**63) - 1), 400, "seed"),
    ("seed 10**30, n=2", "POST", C, c(seed=10**30, n=2), 400, "seed"),
    ("seed 'abc'", "POST", C, c(seed="abc"), 400, "seed"),
    ("temperature NaN seeded (raw JSON)", "POST", C,
     raw('{"prompt": "w1", "max_tokens": 2, "seed": 3, "temperature": NaN}'), 400, "temperature"),
    ("logprobs 100", "POST", C, c(logprobs=100), 400, "logprobs"),
    ("logprobs -1", "POST", C, c(logprobs=-1), 400, "logprobs"),
    ("logprobs 20", "POST", C, c(logprobs=20), 200, None),
    ("chat top_logprobs 100", "POST", CHAT, chat(logprobs=True, top_logprobs=100), 400, "top_logprobs"),
    ("chat top_logprobs -1", "POST", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    ("chat top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat top_logprobs 20", "POST", CHAT, chat(logprobs=True, top_logprobs=20), 200, None),
    # -- priority (a signed 32-bit number, as vLLM's)
    ("priority 1.5", "POST", C, c(priority=1.5), 400, "priority"),
    ("priority 2**31", "POST", C, c(priority=2**31), 400, "priority"),
    ("priority 10**30", "POST", C, c(priority=10**30), 400, "priority"),
    ("priority true (a bool is not a number)", "POST", C, c(priority=True), 400, "priority"),
    # -- kv_budget_tokens (this server runs --kv-eviction none: even a good budget cannot apply)
    ("kv_budget_tokens 0", "POST", C, c(kv_budget_tokens=0), 400, "kv_budget_tokens"),
    ("kv_budget_tokens 1.5", "POST", C, c(kv_budget_tokens=1.5), 400, "kv_budget_tokens"),
    ("kv_budget_tokens 10**30", "POST", C, c(kv_budget_tokens=10**30), 400, "kv_budget_tokens"),
    ("kv_budget_tokens true (a bool is not a count)", "POST", C, c(kv_budget_tokens=True), 400, "kv_budget_tokens"),
    ("kv_budget_tokens without a policy", "POST", C, c(kv_budget_tokens=64), 400, "kv_budget_tokens"),
    # -- stop
    ("stop as int", "POST", C, c(stop=5), 400, "stop"),
    ("stop empty string", "POST", C, c(stop=""), 400, "stop"),
    ("stop list with an int", "POST", C, c(stop=["w3", 4]), 400, "stop"),
    ("stop 64 strings", "POST", C, c(stop=[f"x{i}" for i in range(64)]), 200, None),
    ("stop 1000 strings (over 64)", "POST", C, c(stop=[f"x{i}" for i in range(1000)]), 400, "stop"),
    ("stop string of 1 MB", "POST", C, c(stop=["s" * 2**20]), 400, "stop"),
    ("stop_token_ids 5000 ids (over 1024)", "POST", C, c(stop_token_ids=[7] * 5000), 400, "stop_token_ids"),
    ("stop with NUL", "POST", C, c(stop=["\u0000"]), 200, None),
    ("stop_token_ids [-1]", "POST", C, c(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("stop_token_ids [10**30]", "POST", C, c(stop_token_ids=[10**30]), 400, "stop_token_ids"),
    ("stop_token_ids [2**64]", "POST", C, c(stop_token_ids=[2**64]), 400, "stop_token_ids"),
    ("stop_token_ids [2**64-1]", "POST", C, c(stop_token_ids=[2**64 - 1]), 400, "stop_token_ids"),
    ("chat stop_token_ids [10**30]", "POST", CHAT, chat(stop_token_ids=[10**30]), 400, "stop_token_ids"),
    ("stop_token_ids [true]", "POST", C, c(stop_token_ids=[True]), 400, "stop_token_ids"),
    ("stop_token_ids outside the vocabulary, with min_tokens", "POST", C,
     c(stop_token_ids=[TINY_VOCAB], min_tokens=1), 400, "stop_token_ids"),
    ("stop_token_ids in the vocabulary, with min_tokens", "POST", C, c(stop_token_ids=[7], min_tokens=1), 200,
     None),
    # -- prompts
    ("prompt empty string", "POST", C, c(prompt=""), 400, "prompt"),
    ("prompt empty list", "POST", C, c(prompt=[]), 400, "prompt"),
    ("prompt list of empty lists", "POST", C, c(prompt=[[]]), 400, "prompt"),
    ("prompt list of id lists", "POST", C, c(prompt=[[5, 6], [7]]), 200, None),
    ("prompt list of strings", "POST", C, c(prompt=["w1", "w2 w3"]), 200, None),
    ("prompt mixed list", "POST", C, c(prompt=["w1", 5]), 400, "prompt"),
    ("prompt token id 10**9", "POST", C, c(prompt=[10**9]), 400, "prompt"),
    ("prompt token id -5", "POST", C, c(prompt=[-5]), 400, "prompt"),
    ("prompt token id 2**70", "POST", C, c(prompt=[2**70]), 400, "prompt"),
    ("prompt batch with a bad id", "POST", C, c(prompt=[[5], [6, 10**9]]), 400, "prompt"),
    ("prompt batch with -10**30 in the second prompt", "POST", C, c(prompt=[[5], [6, -10**30]]), 400, "prompt"),
    ("prompt [1, 2**70]", "POST", C, c(prompt=[1, 2**70]), 400, "prompt"),
    ("prompt [1, true]", "POST", C, c(prompt=[1, True]), 400, "prompt"),
    ("prompt 1 MB string", "POST", C, c(prompt=ONE_MB), 400, "prompt"),
    ("prompt longer than the context (600 ids)", "POST", C, c(prompt=[5] * 600), 400, "prompt"),
    ("prompt 511 ids + default max_tokens", "POST", C, {"prompt": [5] * 511}, 400, "prompt"),
    ("prompt 508 ids + max_tokens 4", "POST", C, c(prompt=[5] * 508, max_tokens=4), 200, None),
    ("prompt as int", "POST", C, c(prompt=5), 400, "prompt"),
    ("prompt missing", "POST", C, {"max_tokens": 2}, 400, "prompt"),
    ("prompt null", "POST", C, c(prompt=None), 400, "prompt"),
    ("prompt object", "POST", C, c(prompt={"a": 1}), 400, "prompt"),
    ("batch of 256 prompts", "POST", C, c(prompt=["w1"] * 256, max_tokens=1), 200, None),
    ("batch of 1000 prompts (over --max-seqs-per-request)", "POST", C, c(prompt=["w1"] * 1000, max_tokens=1), 400,
     "prompt"),
    ("64 prompts x n=128", "POST", C, c(prompt=["w1"] * 64, n=128, max_tokens=1), 400, "n"),
    ("unicode / emoji prompt", "POST", C, c(prompt="héllo 🚀 世界"), 200, None),
    ("NUL bytes in the prompt", "POST", C, c(prompt="w1\u0000w2"), 200, None),
    ("lone surrogate (raw JSON)", "POST", C, raw('{"prompt": "\\ud800", "max_tokens": 2}'), 400, "prompt"),
    ("chat lone surrogate (raw JSON)", "POST", CHAT,
     raw('{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'), 400, "messages"),
    ("tokenize lone surrogate (raw JSON)", "POST", TOK, raw('{"prompt": "a\\ud800"}'), 400, "prompt"),
    ("stop lone surrogate (raw JSON)", "POST", C, raw('{"prompt": "w1", "max_tokens": 2, "stop": ["\\ud800"]}'),
     400, "stop"),
    # -- chat messages
    ("messages: role missing", "POST", CHAT, chat(messages=[{"content": "w1"}]), 400, "messages"),
    ("messages: role tool", "POST", CHAT, chat(messages=[{"role": "tool", "content": "w1"}]), 200, None),
    ("messages: role 'banana'", "POST", CHAT, chat(messages=[{"role": "banana", "content": "w1"}]), 200, None),
    ("messages: content null", "POST", CHAT, chat(messages=[{"role": "user", "content": None}]), 200, None),
    ("messages: text parts", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "w1"}]}]), 200, None),
    ("messages: image part", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages"),
    ("messages: part not an object", "POST", CHAT, chat(messages=[{"role": "user", "content": [5]}]), 400,
     "messages"),
    ("messages: empty list", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("messages: not a list", "POST", CHAT, chat(messages="w1"), 400, "messages"),
    ("messages: content int", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    ("messages: assistant last, no generation prompt", "POST", CHAT,
     chat(messages=[{"role": "assistant", "content": "w1"}], add_generation_prompt=False), 200, None),
    ("messages: NUL and emoji", "POST", CHAT, chat(messages=[{"role": "user", "content": "a\u0000🚀"}]), 200, None),
    ("chat 1 MB content", "POST", CHAT, chat(messages=[{"role": "user", "content": ONE_MB}]), 400, "prompt"),
    # -- model, unsupported features, streaming
    ("unknown model", "POST", C, c(model="gpt-4"), 404, "model"),
    ("unknown model chat", "POST", CHAT, chat(model="gpt-4"), 404, "model"),
    ("model omitted", "POST", C, c(), 200, None),
    ("unknown extra fields", "POST", C, c(frobnicate=True, user="u"), 200, None),
    ("guided_json, a keyword that cannot be enforced", "POST", C, c(guided_json={"type": "array", "uniqueItems": True}),
     400, "guided_json"),
    ("allowed_token_ids []", "POST", C, c(allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("truncate_prompt_tokens -5 (not supported)", "POST", C, c(truncate_prompt_tokens=-5), 400,
     "truncate_prompt_tokens"),
    ("bad_words", "POST", C, c(bad_words=["w3"]), 200, None),
    ("chat tool_choice required without tools", "POST", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("suffix", "POST", C, c(suffix="w3"), 400, "suffix"),
    ("echo true", "POST", C, c(echo=True), 200, None),
    ("echo, max_tokens 0", "POST", C, c(echo=True, max_tokens=0, logprobs=1), 200, None),
    ("prompt_logprobs 21", "POST", C, c(prompt_logprobs=21), 400, "prompt_logprobs"),
    ("prompt_logprobs -1", "POST", C, c(prompt_logprobs=-1), 400, "prompt_logprobs"),
    ("echo, logprobs 21", "POST", C, c(echo=True, logprobs=21), 400, "logprobs"),
    ("best_of 3", "POST", C, c(best_of=3), 400, "best_of"),
    ("best_of = n = 200", "POST", C, c(best_of=200, n=200), 400, "n"),
    ("logit_bias", "POST", C, c(logit_bias={"5": 1.0}), 200, None),
    ("logit_bias out of range", "POST", C, c(logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit_bias key 10**30", "POST", C, c(logit_bias={str(10**30): 1.0}), 400, "logit_bias"),
    ("chat logit_bias key 10**30", "POST", CHAT, chat(logit_bias={str(10**30): 1.0}), 400, "logit_bias"),
    ("logit_bias key outside the vocabulary", "POST", C, c(logit_bias={str(TINY_VOCAB): 1.0}), 400, "logit_bias"),
    ("logit_bias key 'abc'", "POST", C, c(logit_bias={"abc": 1.0}), 400, "logit_bias"),
    ("logit_bias value true", "POST", C, c(logit_bias={"5": True}), 400, "logit_bias"),
    ("allowed_token_ids [10**30]", "POST", C, c(allowed_token_ids=[10**30]), 400, "allowed_token_ids"),
    ("chat allowed_token_ids [10**30]", "POST", CHAT, chat(allowed_token_ids=[10**30]), 400, "allowed_token_ids"),
    ("allowed_token_ids outside the vocabulary", "POST", C, c(allowed_token_ids=[TINY_VOCAB]), 400,
     "allowed_token_ids"),
    ("guided_json holding an integer past 64 bits", "POST", C,
     c(guided_json={"type": "integer", "maximum": 10**30}), 400, "guided_json"),
    ("tools malformed", "POST", CHAT, chat(tools=[{"type": "function"}]), 400, "tools"),
    ("response_format unknown type", "POST", CHAT, chat(response_format={"type": "xml"}), 400, "response_format"),
    ("stream_options without stream", "POST", C, c(stream_options={"include_usage": True}), 400, "stream_options"),
    ("stream n=2", "POST", C, c(stream=True, n=2), 200, None),
    ("chat stream n=3", "POST", CHAT, chat(stream=True, n=3), 200, None),
    ("stream 'yes' (not a bool)", "POST", C, c(stream="yes"), 400, "stream"),
    ("stream 1 (not a bool)", "POST", C, c(stream=1), 400, "stream"),
    ("ignore_eos 'yes' (not a bool)", "POST", C, c(ignore_eos="yes"), 400, "ignore_eos"),
    ("chat logprobs 1 (not a bool)", "POST", CHAT, chat(logprobs=1), 400, "logprobs"),
    ("stream_options.include_usage 'true'", "POST", C, c(stream=True, stream_options={"include_usage": "true"}),
     400, "stream_options"),
    # -- the other routes
    ("tokenize NUL / emoji", "POST", TOK, {"prompt": "a\u0000🚀"}, 200, None),
    ("tokenize neither prompt nor messages", "POST", TOK, {}, 400, "prompt"),
    ("detokenize 10**9", "POST", DETOK, {"tokens": [10**9]}, 400, "tokens"),
    ("detokenize -1", "POST", DETOK, {"tokens": [-1]}, 400, "tokens"),
    ("detokenize 2**70", "POST", DETOK, {"tokens": [2**70]}, 400, "tokens"),
    ("detokenize [true]", "POST", DETOK, {"tokens": [True]}, 400, "tokens"),
    ("GET on a POST route", "GET", C, None, 405, None),
    ("unknown route", "POST", "/v1/no-such-route", c(), 404, None),
]

LEAKS = ("Traceback", 'File "', "site-packages", "0x7f")  # no stack traces, paths or addresses in any answer


def _send(url: str, method: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.request(method, url + path, content=body, headers={"content-type": "application/json"},
                             timeout=60)
    return httpx.request(method, url + path, json=body, timeout=60)


@pytest.mark.parametrize("name,method,path,body,status,param", CASES, ids=[case[0] for case in CASES])
def test_bad_input_table(server, name, method, path, body, status, param):
    resp = _send(server.url, method, path, body)
    assert resp.status_code == status, resp.text[:300]
    assert not any(marker in resp.text for marker in LEAKS), resp.text[:300]
    if status >= 400:
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param, error
    elif resp.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events[:-1])
    # After every case: healthy, and an ordinary request is served.
    assert httpx.get(server.url + "/health").status_code == 200
    ok = httpx.post(server.url + C, json={"prompt": "w1 w2", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_the_table_covers_every_sampling_field():
    """A new numeric request field must come with bad-input cases."""
    from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest

    numeric = set()
    for model in (CompletionRequest, ChatCompletionRequest):
        for name, field in model.model_fields.items():
            if any(t in str(field.annotation) for t in ("int", "float")):
                numeric.add(name)
    covered = {key for case in CASES if isinstance(case[3], dict) for key in case[3]}
    covered |= {case[5] for case in CASES}
    assert numeric - covered == set()


# ---- slow and silent clients ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def strict_server(tiny_chat_dir):
    with serve_model(tiny_chat_dir, server_kwargs={"timeout_keep_alive": 1.0, "timeout_headers": 1.0}) as (url, app):
        yield url


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (sending ``trickle`` one byte every 0.2 s)."""
    deadline = time.monotonic() + seconds
    sent = 0
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if sock.recv(1024) == b"":
                return True
        except socket.timeout:
            pass
        except ConnectionResetError:
            return True
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent:sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                return True
            sent += 1
    return False


def test_silent_and_trickling_connections_are_closed(strict_server):
    port = int(strict_server.rsplit(":", 1)[1])
    silent = socket.create_connection(("127.0.0.1", port))
    trickling = socket.create_connection(("127.0.0.1", port))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    try:
        assert _closed_within(silent, 10.0), "a silent connection stayed open"
        assert _closed_within(trickling, 10.0, trickle=head), "a trickling connection stayed open"
    finally:
        silent.close()
        trickling.close()
    # Ordinary clients are unaffected, keep-alive included: two requests on one connection.
    with httpx.Client(base_url=strict_server) as client:
        for _ in range(2):
            assert client.post(C, json={"prompt": "w1", "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def long_keepalive_server(tiny_chat_dir):
    with serve_model(tiny_chat_dir, server_kwargs={"timeout_keep_alive": 60.0, "timeout_headers": 1.0}) as (url, app):
        yield url


def _request_on(sock: socket.socket, trickle_s: float = 0.0) -> bytes:
    """One keep-alive completion request on ``sock`` (its head sent whole, or a byte every ``trickle_s``); the
    response's bytes, b"" if the server closed the connection instead."""
    body = json.dumps({"prompt": "w1", "max_tokens": 2}).encode()
    raw = (b"POST " + C.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    sock.settimeout(30)
    try:
        if trickle_s:
            for i in range(len(raw)):
                sock.sendall(raw[i:i + 1])
                time.sleep(trickle_s)
        else:
            sock.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
        return data
    except (BrokenPipeError, ConnectionResetError):
        return b""


def _content_length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def test_an_idle_keep_alive_connection_outlives_the_header_deadline(long_keepalive_server):
    """Between a response and the next request only --timeout-keep-alive closes a connection (60 s here): idle
    for longer than --timeout-headers (1 s), it still serves; a later request's head that trickles in is held
    to the header deadline from its first byte."""
    port = int(long_keepalive_server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        assert _request_on(sock).startswith(b"HTTP/1.1 200")
        time.sleep(2.5)  # idle past the header deadline, well inside the keep-alive
        assert _request_on(sock).startswith(b"HTTP/1.1 200"), "an idle keep-alive connection was closed early"
        assert _closed_within(sock, 10.0, trickle=b"POST " + C.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Slow: "
                              + b"a" * 200), "a request head trickling after a response was never cut off"


# ---- a dead engine ----------------------------------------------------------------------------------------
def crash_on_demand(engine):
    """Make ``engine.step`` raise once ``crash`` is set: the injected fault that kills the engine thread."""
    crash = threading.Event()
    step = engine.step

    def step_or_crash():
        if crash.is_set():
            raise RuntimeError("injected engine fault")
        return step()

    engine.step = step_or_crash
    return crash


def stream_lines(url: str, body: dict, on_first=None) -> list[str]:
    lines = []
    with httpx.stream("POST", url + C, json={**body, "stream": True}, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 1 and on_first is not None:
                    on_first()
    return lines


def test_a_dead_engine_fails_in_flight_requests_and_health(tiny_chat_dir):
    engine = make_engine(tiny_chat_dir)
    crash = crash_on_demand(engine)
    app = build_app(engine, "tiny", log_stats_interval_s=0.0, shutdown_timeout_s=2.0)
    with running_server(app, exit_on_engine_death=False) as url:  # stays up, so its answers can be checked
        lines = stream_lines(url, {"prompt": "w1", "max_tokens": 400, "ignore_eos": True}, on_first=crash.set)
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "engine_dead"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        later = httpx.post(url + C, json={"prompt": "w1", "max_tokens": 2})
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"


def test_a_dead_engine_shuts_the_server_down(tiny_chat_dir, caplog):
    engine = make_engine(tiny_chat_dir)
    crash = crash_on_demand(engine)
    app = build_app(engine, "tiny", log_stats_interval_s=0.0, shutdown_timeout_s=30.0)
    with running_server(app) as url:
        lines = stream_lines(url, {"prompt": "w1", "max_tokens": 400, "ignore_eos": True}, on_first=crash.set)
        assert json.loads(lines[-2])["error"]["code"] == "engine_dead"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the listener closes: nothing is served any more
            try:
                httpx.get(url + "/health", timeout=1)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                break  # refused, or (caught mid-shutdown) accepted and closed without an answer
            time.sleep(0.05)
        else:
            pytest.fail("the server still accepts connections 10 s after its engine died")
    deaths = [r for r in caplog.records if "the engine died" in r.getMessage()]
    assert len(deaths) == 1 and deaths[0].levelname == "CRITICAL"


def test_a_request_that_fails_inside_the_engine_is_a_500_for_it_alone():
    from conveyor.engine.async_engine import RequestFailedError
    from conveyor.server.errors import from_engine_error

    error = from_engine_error(RequestFailedError("could not seed its sampling generator: ValueError('x')"))
    assert error.status == 500 and error.code == "request_failed" and "sampling generator" in error.message
