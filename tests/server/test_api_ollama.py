"""The Ollama API through a real server, with the ``ollama`` Python client and LangChain's ChatOllama, on the
scripted model (tests/helpers/scripted.py: it thinks ``ok`` and answers ``Paris``): chat and generate, streamed
(NDJSON) and not, list / show / ps / version, ``format`` with a schema, tools, ``think``, ``name:tag`` names, and
bad input as Ollama's ``{"error"}``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from tests.helpers.scripted import ANSWER, REASONING, WEATHER_SCHEMA, serve_scripted

pytestmark = pytest.mark.slow  # a real server

MODEL = "scripted"
ASK = [{"role": "user", "content": "Capital of France?"}]
GREEDY = {"temperature": 0}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": WEATHER_SCHEMA}}]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serve_scripted(tmp_path_factory.mktemp("scripted")) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return ollama.Client(host=url, timeout=60)


def test_chat_streamed_and_not_keeps_thinking_apart(client):
    reply = client.chat(model=MODEL, messages=ASK, options=GREEDY)
    assert (reply.message.content, reply.message.thinking, reply.done, reply.done_reason) == (
        ANSWER, REASONING, True, "stop")
    assert reply.prompt_eval_count > 0 and reply.eval_count == 10 and reply.total_duration > 0
    pieces = list(client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in pieces) == ANSWER and len(pieces) >= 2  # text, then the stats
    assert "".join(p.message.thinking or "" for p in pieces) == REASONING
    assert [p.done for p in pieces] == [False] * (len(pieces) - 1) + [True]
    off = client.chat(model=f"{MODEL}:latest", messages=ASK, options=GREEDY, think=False)
    assert (off.message.content, off.message.thinking) == (ANSWER, None)


def test_generate_streamed_and_not_with_its_context(client):
    reply = client.generate(model=MODEL, prompt="Capital of France?", options=GREEDY, think=False)
    assert reply.response == ANSWER and reply.done and reply.context
    pieces = list(client.generate(model=MODEL, prompt="Capital of France?", options=GREEDY, stream=True))
    assert "".join(p.response for p in pieces) == ANSWER and "".join(p.thinking or "" for p in pieces) == REASONING
    cut = client.generate(model=MODEL, prompt="Capital?", options={**GREEDY, "num_predict": 2}, think=False)
    assert (cut.response, cut.done_reason) == ("Pa", "length")
    stopped = client.generate(model=MODEL, prompt="Capital?", options={**GREEDY, "stop": ["ri"]}, think=False)
    assert stopped.response == "Pa"
    # raw: the prompt as given, no template (the script then starts from its last token, which opens the block)
    raw = client.generate(model=MODEL, prompt="<think>", raw=True, options=GREEDY)
    assert (raw.response, raw.thinking) == (ANSWER, REASONING)


def test_list_show_ps_and_version(client, url):
    (listed,) = client.list().models
    assert listed.model == f"{MODEL}:latest" and listed.details.family == "llama" and listed.size > 0
    shown = client.show(f"{MODEL}:latest")
    assert "enable_thinking" in shown.template and "thinking" in shown.capabilities
    assert shown.modelinfo["llama.context_length"] == 1024
    (running,) = client.ps().models
    assert running.model == listed.model and running.context_length == 1024
    assert httpx.get(url + "/api/version").json()["version"]


def test_format_with_a_schema_and_tools(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    reply = client.chat(model=MODEL, messages=ASK, format=schema, options={**GREEDY, "num_predict": 60},
                        think=False)
    jsonschema.validate(json.loads(reply.message.content), {**schema, "additionalProperties": False})
    # "json": any object (the scripted model never closes one: what it wrote by num_predict is one's start)
    as_json = client.generate(model=MODEL, prompt="x", format="json", options={**GREEDY, "num_predict": 8},
                              think=False)
    assert as_json.response.startswith('{"') and as_json.done_reason == "length"
    # tools (auto: the generic format on this template); the call and its result round trip
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "12 C", "tool_name": "get_weather"}]
    answer = client.chat(model=MODEL, messages=history, tools=TOOLS, options={**GREEDY, "num_predict": 20},
                         think=False)
    assert answer.done


def test_langchain_chat_ollama(url):
    from langchain_ollama import ChatOllama

    llm = ChatOllama(model=MODEL, base_url=url, temperature=0, reasoning=False)
    assert llm.invoke("Capital of France?").content == ANSWER
    thinking = ChatOllama(model=MODEL, base_url=url, temperature=0, reasoning=True).invoke("Capital?")
    assert thinking.content == ANSWER and thinking.additional_kwargs.get("reasoning_content") == REASONING


BAD = [  # (path, body fields, status, what the error names)
    ("/api/chat", {"model": "llama3.2:latest"}, 404, "llama3.2"),
    ("/api/chat", {"options": {"num_ctx": 99999}}, 400, "num_ctx"),
    ("/api/chat", {"options": {"mirostat": 2}}, 400, "mirostat"),
    ("/api/chat", {"options": {"temperature": "hot"}}, 400, "temperature"),
    ("/api/chat", {"options": {"flux_capacitor": 1}}, 400, "flux_capacitor"),
    ("/api/chat", {"options": {"num_predict": 0}}, 400, "num_predict"),
    ("/api/chat", {"format": "yaml"}, 400, "format"),
    ("/api/chat", {"think": "very"}, 400, "think"),
    ("/api/chat", {"messages": [{"role": "tool", "content": "x"}]}, 400, "tool"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["AAAA"]}]}, 400, "images"),
    ("/api/generate", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/api/generate", {"prompt": "x", "context": [-1]}, 400, "context"),
    ("/api/show", {"model": "mistral"}, 404, "mistral"),
]


@pytest.mark.parametrize("path,fields,status,named", BAD, ids=[f"{p[5:]}-{n}" for p, _, _, n in BAD])
def test_bad_input_is_ollamas_error_and_the_server_serves_on(client, url, path, fields, status, named):
    body = {"model": MODEL, "messages": ASK, "stream": False, **fields}
    resp = httpx.post(url + path, json=body, timeout=60)
    assert resp.status_code == status and set(resp.json()) == {"error"}, resp.text
    assert named in resp.json()["error"], resp.text
    assert client.chat(model=MODEL, messages=ASK, options={"num_predict": 2}).done


def test_loading_and_unloading_as_ollama_answers_them(client):
    assert client.chat(model=MODEL, messages=[]).done_reason == "load"
    assert client.generate(model=MODEL, prompt="", keep_alive=0).done_reason == "unload"
