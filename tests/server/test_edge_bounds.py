"""Bounds at the edge of the server (issue 24, items 4-6; review defects D-5 to D-8): the request body's size and
encoding, a text prompt too long for the context refused before it is tokenized, sequences per request, stop
conditions, and the vLLM fields conveyor does not implement refused instead of silently dropped.

The server tests run a real uvicorn on 127.0.0.1 serving the tiny Llama with a byte-level tokenizer (every
character of a text costs tokens, as with the real models' tokenizers). After every refused request the server
must still answer ``/health`` and an ordinary completion.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi import HTTPException

from conveyor.server.app import build_app
from conveyor.server.body_limit import BodyLimitMiddleware
from conveyor.server.limits import (
    DEFAULT_MAX_REQUEST_BODY_BYTES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, max_token_chars,
)
from conveyor.server.protocol import REFUSED_FIELDS
from tests.helpers.checkpoints import save_tiny_llama, write_byte_tokenizer
from tests.helpers.server import CHAT_TEMPLATE, make_engine, running_server

SLOW = pytest.mark.slow  # a real (tiny) model and server: run by CI, skipped by -m "not slow"
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi there"}]
MAX_MODEL_LEN = 512  # the tiny Llama's
@pytest.fixture(scope="module")
def byte_chat_dir(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-bytes"))
    write_byte_tokenizer(path, CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(byte_chat_dir):
    """The server with build_app's defaults; ``encoded`` holds the length of every text the tokenizer was asked
    to encode since the app was built."""
    engine = make_engine(byte_chat_dir)
    app = build_app(engine, "tiny", log_stats_interval_s=0.0, shutdown_timeout_s=2.0)
    encoded: list[int] = []
    tokenizer, encode = engine.tokenizer, engine.tokenizer.encode

    def spy(text, add_special_tokens=True):
        encoded.append(len(text))
        return encode(text, add_special_tokens=add_special_tokens)

    tokenizer.encode = spy
    with running_server(app) as url:
        yield SimpleNamespace(url=url, encoded=encoded, chars_limit=MAX_MODEL_LEN * max_token_chars(tokenizer))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def assert_still_serves(url: str) -> None:
    assert httpx.get(url + "/health").status_code == 200
    ok = httpx.post(url + C, json={"prompt": "hello", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def assert_error(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text[:300]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error


def raw_exchange(url: str, head: bytes, chunks=(), timeout: float = 10.0) -> bytes:
    """Send a request head and ``chunks`` over a socket that stays open, then read one answer (b"" if none
    comes within ``timeout``)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        try:
            sock.sendall(head)
            for chunk in chunks:
                sock.sendall(chunk)
        except OSError:  # closed after its answer
            pass
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _content_length(answer):
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
        except (ConnectionResetError, socket.timeout):
            pass
    return answer


def _content_length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _status_and_error(answer: bytes) -> tuple[int, dict, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)["error"], head.lower()


# ---- the request body: 413 over the cap, 415 compressed ---------------------------------------------------
def _completion_head(extra: bytes) -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra + b"\r\n"


@SLOW
def test_a_declared_length_over_the_cap_is_413_before_any_body_is_sent(server):
    """A client that waits for 100 Continue before its body (curl does for large ones) gets the 413 instead."""
    head = _completion_head(b"Content-Length: %d\r\nExpect: 100-continue\r\n" % (DEFAULT_MAX_REQUEST_BODY_BYTES + 1))
    start = time.monotonic()
    answer = raw_exchange(server.url, head)  # no body at all: a server that waited for it would time out
    assert answer, "no answer: the server waits for a body it should have refused"
    status, error, headers = _status_and_error(answer)
    assert status == 413 and error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert b"connection: close" in headers and time.monotonic() - start < 5
    assert_still_serves(server.url)


@SLOW
def test_a_body_over_the_cap_is_413_and_one_at_the_cap_is_read(server):
    over = b'{"prompt": "' + b"a" * DEFAULT_MAX_REQUEST_BODY_BYTES + b'"}'
    resp = httpx.post(server.url + C, content=over, headers={"content-type": "application/json"}, timeout=60)
    assert "over this server's limit" in assert_error(resp, 413, None)["message"]
    padding = DEFAULT_MAX_REQUEST_BODY_BYTES - len(b'{"prompt": "", "max_tokens": 1}')
    at_cap = b'{"prompt": "' + b"a" * padding + b'", "max_tokens": 1}'
    assert len(at_cap) == DEFAULT_MAX_REQUEST_BODY_BYTES
    resp = httpx.post(server.url + C, content=at_cap, headers={"content-type": "application/json"}, timeout=60)
    assert_error(resp, 400, "prompt")  # read and parsed: too long a prompt, not too big a body
    assert_still_serves(server.url)


@SLOW
def test_a_chunked_body_over_the_cap_is_413_as_soon_as_the_cap_is_crossed(server):
    def body():  # a generator: httpx sends it chunked, without Content-Length
        yield b'{"prompt": "'
        for _ in range(2 * DEFAULT_MAX_REQUEST_BODY_BYTES // 65536):
            yield b"a" * 65536
        yield b'"}'

    resp = httpx.post(server.url + C, content=body(), headers={"content-type": "application/json"}, timeout=60)
    assert "content-length" not in resp.request.headers and resp.request.headers["transfer-encoding"] == "chunked"
    assert_error(resp, 413, None)
    # Over a raw socket: the answer comes once the body has ended (it was read and dropped past the cap), so the
    # client, which sent it whole, reads it.
    chunk = b"a" * 65536
    head = _completion_head(b"Transfer-Encoding: chunked\r\n")
    chunks = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (DEFAULT_MAX_REQUEST_BODY_BYTES // len(chunk) + 2)
    answer = raw_exchange(server.url, head, [*chunks, b"0\r\n\r\n"])
    assert answer, "no answer to a body over the cap"
    assert _status_and_error(answer)[0] == 413
    assert_still_serves(server.url)


def slow_upload(url: str, head: bytes, body: bytes, chunk: int = 65536, pause_s: float = 0.005) -> tuple[str, bytes]:
    """Send ``head`` and then ``body`` a chunk at a time with a pause between chunks, as a client across a network
    uploads, then read the answer. Returns (how the upload went: "sent" or the error that cut it, the answer)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        went = "sent"
        try:
            for i in range(0, len(body), chunk):
                sock.sendall(body[i:i + chunk])
                time.sleep(pause_s)
        except OSError as exc:  # the server closed or reset the connection under the upload
            went = type(exc).__name__
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
        except OSError:
            pass
    return went, answer


@SLOW
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_cap_uploaded_at_network_speed_is_read_to_its_end_then_413(server, declared):
    """The probe's held-out load phase: a 4 MB field, and httpx (so the openai SDK) saw a broken connection, never
    the 413. A server that answers as soon as it knows and closes cuts an upload still under way; this one reads the
    rest and drops it, then answers, so the client's upload completes and the 413 is there to read. (Twice the cap:
    more than the socket buffers hold after the cap is crossed.)"""
    body = b'{"prompt": "' + b"a" * (2 * DEFAULT_MAX_REQUEST_BODY_BYTES) + b'"}'
    if declared:
        head = _completion_head(b"Content-Length: %d\r\n" % len(body))
    else:
        head = _completion_head(b"Transfer-Encoding: chunked\r\n")
        body = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 65536]), body[i:i + 65536])
                        for i in range(0, len(body), 65536)) + b"0\r\n\r\n"
    went, answer = slow_upload(server.url, head, body)
    assert went == "sent", f"the upload was cut: {went}; answer {answer[:200]!r}"
    assert _status_and_error(answer)[0] == 413, answer[:300]
    assert_still_serves(server.url)


@SLOW
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_httpx_reads_the_413_of_a_body_just_over_the_cap(server, declared):
    """The probe's held-out load phase: a 4 MB field over the 4 MiB cap. httpx sends the whole body before it reads
    the answer; a server that answered early and closed left it a broken connection, never the 413."""
    body = b'{"prompt": "' + b"a" * (DEFAULT_MAX_REQUEST_BODY_BYTES + 100_000) + b'"}'
    content = body if declared else iter([body[i:i + 65536] for i in range(0, len(body), 65536)])
    for _ in range(2):  # every time, not by luck of the socket buffers
        resp = httpx.post(server.url + C, content=content, headers={"content-type": "application/json"}, timeout=60)
        assert_error(resp, 413, None)
        content = body if declared else iter([body[i:i + 65536] for i in range(0, len(body), 65536)])
    assert_still_serves(server.url)


@SLOW
def test_a_gzip_body_is_415_not_misread(server):
    body = gzip.compress(json.dumps({"prompt": "hello", "max_tokens": 2}).encode())
    for encoding in ("gzip", "deflate, identity", "br"):
        resp = httpx.post(server.url + C, content=body, timeout=60,
                          headers={"content-type": "application/json", "content-encoding": encoding})
        assert "not supported" in assert_error(resp, 415, None)["message"]
    plain = httpx.post(server.url + C, json={"prompt": "hello", "max_tokens": 2}, headers={
        "content-encoding": "identity"}, timeout=60)
    assert plain.status_code == 200
    assert_still_serves(server.url)


@SLOW
def test_the_official_client_gets_413_for_a_huge_prompt(client, server):
    for size in (DEFAULT_MAX_REQUEST_BODY_BYTES + 1, 20 * 2**20):  # just over; the probe's 20 MB
        for _ in range(2):
            with pytest.raises(openai.APIStatusError) as info:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a" * size}],
                                               max_tokens=1)
            assert info.value.status_code == 413 and info.value.code == "request_too_large"
    assert_still_serves(server.url)


def test_responses_pass_through_the_body_limit_unbuffered():
    """SSE streams: each message the app sends reaches the server before the app sends the next."""
    events: list = []

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(3):
            await send({"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True})
            events.append(("app sent", i))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        events.append(("server got", message.get("body")))

    asyncio.run(BodyLimitMiddleware(app, 10)({"type": "http", "headers": []}, receive, send))
    assert events[1:7] == [("server got", b"data: 0\n\n"), ("app sent", 0), ("server got", b"data: 1\n\n"),
                           ("app sent", 1), ("server got", b"data: 2\n\n"), ("app sent", 2)]


def test_the_body_limit_hands_the_app_no_more_than_the_cap():
    """A client that sends on and on: the app is handed at most the cap; the read that crosses it raises the 413
    (which FastAPI hands to the error handlers: the HTTP tests above see the answer)."""
    pulled, seen, sent = [], [], []

    async def app(scope, receive, send):
        while True:
            message = await receive()
            seen.append(message["type"])
            if not message.get("more_body"):
                break

    async def receive():  # "forever": 100 chunks, so that a limit that does not count fails instead of hanging
        pulled.append(1000)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": len(pulled) < 100}

    async def send(message):
        sent.append(message)

    with pytest.raises(HTTPException) as refused:
        asyncio.run(BodyLimitMiddleware(app, 10_000)({"type": "http", "headers": []}, receive, send))
    # The chunk that crossed the cap is the last one the app got; the rest was read and dropped, so that the client
    # (which sends its whole body before it reads) gets to read the 413.
    assert sum(pulled) == 100_000
    assert seen == ["http.request"] * 10 and not sent
    assert refused.value.status_code == 413 and refused.value.headers == {"Connection": "close"}


def test_a_refused_body_is_drained_only_up_to_its_bound(monkeypatch):
    """A body that goes on past DRAIN_MAX_BYTES is not read to its end: the answer goes out after the bound."""
    from conveyor.server import body_limit

    monkeypatch.setattr(body_limit, "DRAIN_MAX_BYTES", 50_000)
    pulled = []

    async def receive():
        pulled.append(1000)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    assert asyncio.run(body_limit.drain(receive, 50_000)) is False and sum(pulled) == 51_000


# ---- a text prompt too long for the context, refused by its length ----------------------------------------
def test_max_token_chars_of_the_byte_word_and_embedded_tokenizers(byte_chat_dir, tiny_chat_dir):
    from conveyor.tokenizer import ByteTokenizer, load_tokenizer

    assert max_token_chars(load_tokenizer(str(byte_chat_dir))) == len("<unk>") + 1
    assert max_token_chars(ByteTokenizer()) == 7 + 1  # its pseudo-words: 3 syllables of 2 letters after a space
    # The tests' word tokenizer folds any run of whitespace into nothing and any unknown word into one <unk>:
    # no number of characters is certain to exceed the context, so there is no bound (and no check).
    assert max_token_chars(load_tokenizer(str(tiny_chat_dir))) is None


@SLOW
def test_max_token_chars_of_smollm2_bounds_real_text():
    from conveyor.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)  # SmolLM2-135M-Instruct's byte-level BPE
    bound = max_token_chars(tokenizer)
    assert bound is not None and 16 < bound < 200  # its longest tokens are runs of spaces, '#' and '-'
    for text in (" " * 5000, "#" * 5000, "-" * 5000, "The quick brown fox. " * 200, "\n" * 3000 + "x" * 3000):
        assert len(text) <= bound * len(tokenizer.encode(text, add_special_tokens=False))


@SLOW
def test_a_prompt_longer_than_the_context_can_hold_is_400_without_tokenizing(server, client):
    limit = server.chars_limit
    cases = [(C, {"prompt": "a" * (limit + 1), "max_tokens": 1}, "prompt"),
             (C, {"prompt": ["hello", "a" * (limit + 1)], "max_tokens": 1}, "prompt"),
             (C, {"prompt": "a" * (DEFAULT_MAX_REQUEST_BODY_BYTES - 100), "max_tokens": 1}, "prompt"),
             (CHAT, {"messages": [{"role": "user", "content": "a" * (limit // 2)},
                                  {"role": "user", "content": "b" * (limit // 2 + 1)}]}, "messages")]
    for path, body, param in cases:
        server.encoded.clear()
        start = time.monotonic()
        resp = httpx.post(server.url + path, json=body, timeout=60)
        assert "characters" in assert_error(resp, 400, param)["message"]
        assert server.encoded == [], "the prompt reached the tokenizer"
        assert time.monotonic() - start < 10
        assert_still_serves(server.url)
    server.encoded.clear()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="a" * (limit + 1), max_tokens=1)
    assert info.value.param == "prompt" and server.encoded == []
    # At the bound the prompt might fit, so it is tokenized; its token count refuses it.
    resp = httpx.post(server.url + C, json={"prompt": "a" * limit, "max_tokens": 1}, timeout=60)
    assert "characters" not in assert_error(resp, 400, "prompt")["message"] and limit in server.encoded
    assert_still_serves(server.url)


# ---- sequences per request --------------------------------------------------------------------------------
@SLOW
@pytest.mark.parametrize("prompts,n,status,param", [
    (257, 1, 400, "prompt"), (10_000, 1, 400, "prompt"), (64, 128, 400, "n"), (3, 100, 400, "n"),
    (1, 129, 400, "n"), (2, 128, 200, None), (256, 1, 200, None)])
def test_prompts_times_n_is_bounded(server, prompts, n, status, param):
    resp = httpx.post(server.url + C, json={"prompt": ["hi"] * prompts, "n": n, "max_tokens": 1}, timeout=120)
    if status == 200:
        assert resp.status_code == 200 and len(resp.json()["choices"]) == prompts * n
    else:
        assert_error(resp, status, param)
    assert_still_serves(server.url)


def test_the_serve_flags_parse_and_refuse_nonsense():
    import argparse

    from conveyor.serve import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    ns = parser.parse_args(["serve"])
    assert ns.max_request_body_bytes == DEFAULT_MAX_REQUEST_BODY_BYTES == 4 * 1024 * 1024
    assert ns.max_seqs_per_request == 256
    ns = parser.parse_args(["serve", "--max-request-body-bytes", "1000", "--max-seqs-per-request", "8"])
    assert (ns.max_request_body_bytes, ns.max_seqs_per_request) == (1000, 8)
    for flag in ("--max-request-body-bytes", "--max-seqs-per-request"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", flag, "0"])


# ---- stop conditions ----------------------------------------------------------------------------------------
STOPS = [
    ("too many stop strings", {"stop": [f"x{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ("a stop string too long", {"stop": ["s" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
    ("a 1 MB stop string", {"stop": "s" * 2**20}, "stop"),
    ("too many stop_token_ids", {"stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
]


@SLOW
@pytest.mark.parametrize("path", [C, CHAT])
@pytest.mark.parametrize("name,fields,param", STOPS, ids=[s[0] for s in STOPS])
def test_stop_conditions_beyond_the_bounds_are_400(server, path, name, fields, param):
    base = {"prompt": "hello"} if path == C else {"messages": MSG}
    resp = httpx.post(server.url + path, json={**base, "max_tokens": 2, **fields}, timeout=60)
    assert_error(resp, 400, param)
    assert_still_serves(server.url)


@SLOW
def test_stop_conditions_at_the_bounds_are_served(server):
    fields = {"stop": ["s" * MAX_STOP_STRING_CHARS] + [f"x{i}" for i in range(MAX_STOP_STRINGS - 1)],
              "stop_token_ids": [7] * MAX_STOP_TOKEN_IDS}
    resp = httpx.post(server.url + C, json={"prompt": "hello", "max_tokens": 2, **fields}, timeout=60)
    assert resp.status_code == 200, resp.text[:300]


@SLOW
@pytest.mark.parametrize("path", [C, CHAT])
def test_a_lone_surrogate_in_stop_is_400(server, path):
    base = '"prompt": "hello"' if path == C else '"messages": [{"role": "user", "content": "hi"}]'
    for stop in ('"\\ud800"', '["ok", "a\\udfff"]'):
        resp = httpx.post(server.url + path, content=f'{{{base}, "max_tokens": 2, "stop": {stop}}}'.encode(),
                          headers={"content-type": "application/json"}, timeout=60)
        assert "not valid Unicode" in assert_error(resp, 400, "stop")["message"]
    assert_still_serves(server.url)


# ---- fields conveyor does not implement: 400, not silently dropped ----------------------------------------
REFUSED = [  # (endpoint, fields): each must be answered 400 "<field> is not supported", param = the field
    *((C, {name: value}) for name, value in (
        ("guided_whitespace_pattern", " *"), ("structural_tag", "{}"),
        ("truncate_prompt_tokens", -5), ("truncate_prompt_tokens", 4), ("logits_processors", ["my.Processor"]),
        ("vllm_xargs", {"x": 1}), ("prompt_embeds", "AAAA"), ("suffix", "end"), ("use_beam_search", True),
        ("return_tokens_as_token_ids", True), ("return_token_ids", True), ("spaces_between_special_tokens", False),
        ("cache_salt", "salt"), ("kv_transfer_params", {"do_remote_decode": True}),
        ("max_repetition_pattern_size", 4))),
    *((CHAT, {name: value}) for name, value in (
        ("truncate_prompt_tokens", -5), ("logits_processors", ["my.Processor"]), ("prompt_logprobs", 1),
        ("chat_template", "{{ messages }}"),
        ("documents", [{"title": "a", "text": "b"}]),
        ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"), ("audio", {"voice": "alloy"}),
        ("modalities", ["text", "audio"]), ("web_search_options", {}))),
]


def _refused_id(case) -> str:
    path, fields = case
    return ("chat " if path == CHAT else "") + ",".join(f"{k}={v!r}"[:40] for k, v in fields.items())


@SLOW
@pytest.mark.parametrize("path,fields", REFUSED, ids=[_refused_id(c) for c in REFUSED])
def test_an_unimplemented_field_is_400_not_ignored(server, path, fields):
    base = {"prompt": "hello"} if path == C else {"messages": MSG}
    (name,) = fields
    resp = httpx.post(server.url + path, json={**base, "max_tokens": 2, **fields}, timeout=60)
    assert assert_error(resp, 400, name)["message"].startswith(f"{name} is not supported")
    assert_still_serves(server.url)


@SLOW
def test_the_official_client_gets_400_for_an_unimplemented_extra(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2,
                                       extra_body={"structural_tag": "{}"})
    assert info.value.param == "structural_tag"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, tool_choice="required")
    assert info.value.param == "tool_choice"


@SLOW
def test_fields_real_clients_send_stay_accepted(server, client):
    """What the OpenAI SDK, LangChain and LiteLLM send routinely, and the values of refused fields that ask for
    nothing (clients that fill in every default send them): 200."""
    harmless = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "seed": 3, "n": 2,
                "parallel_tool_calls": True, "tool_choice": "none", "response_format": {"type": "text"},
                "logit_bias": {}, "bad_words": [], "tools": [], "continue_final_message": False, "echo": False,
                "priority": 0, "spaces_between_special_tokens": True, "use_beam_search": False,
                "request_id": "r-1", "reasoning_effort": "low", "length_penalty": 1.0, "guided_json": None,
                "truncate_prompt_tokens": None, "frobnicate": 1, "prediction": {"type": "content", "content": "x"},
                "safety_identifier": "s", "prompt_cache_key": "k", "mm_processor_kwargs": {}}
    resp = httpx.post(server.url + CHAT, json={"messages": MSG, "max_tokens": 2, **harmless}, timeout=60)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 2, resp.text[:300]
    completion = {k: v for k, v in harmless.items() if k not in ("continue_final_message", "tool_choice")}
    resp = httpx.post(server.url + C, json={"prompt": "hello", "max_tokens": 2, **completion, "echo": True},
                      timeout=60)
    assert resp.status_code == 200, resp.text[:300]
    stream = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, stream=True, user="u",
                                            stream_options={"include_usage": True}, seed=1, n=1,
                                            metadata={"a": "b"}, store=False, service_tier="auto")
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_every_field_the_review_names_is_refused_in_one_place():
    names = {f.name for f in REFUSED_FIELDS}
    assert names >= {"guided_whitespace_pattern", "structural_tag", "truncate_prompt_tokens", "logits_processors",
                     "prompt_embeds", "functions", "function_call", "suffix"}
    # served now (tests/engine/test_structured_outputs.py, tests/server/test_server_structured.py): no longer refused
    assert not names & {"guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                        "response_format", "allowed_token_ids", "bad_words", "logit_bias", "tools", "tool_choice"}
    assert len(names) == len(REFUSED_FIELDS)  # one entry per field
    covered = {name for _, fields in REFUSED for name in fields}
    assert names - covered <= {"min_repetition_pattern_size", "repetition_min_count"}  # a server test for each
