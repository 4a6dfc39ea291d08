"""Structured outputs and tool calling through a real server in the default layout (the engine core in its own
process, uvicorn on 127.0.0.1), with the clients applications use: the official ``openai`` SDK (``parse`` with a
pydantic model, tools), LangChain (``with_structured_output``, ``bind_tools``), instructor and LiteLLM.

The embedded random-weights model writes any bytes and, unconstrained, never valid JSON: each reply that parses
and validates below does so because the constraint held.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from conveyor.engine.args import EngineArgs
from conveyor.engine.core_client import EngineCoreClient
from conveyor.server.app import build_app
from tests.helpers.server import running_server

MODEL = "conveyor-embedded-llama-40m-random"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
MSG = [{"role": "user", "content": "hi"}]


class Person(BaseModel):
    # No other keys (additionalProperties: false): JSON Schema allows them by default, and a random model fills
    # them with keys of any length
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def url():
    core = EngineCoreClient(EngineArgs(model=MODEL, dtype="float32", max_model_len=2048, num_kv_blocks=1024))
    app = build_app(core, "tiny", log_stats_interval_s=0.0, shutdown_timeout_s=2.0)
    with running_server(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def _valid(text: str, schema: dict = SCHEMA) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, schema)
    return obj


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_with_n_4_streaming_or_not(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    kw = dict(model="tiny", messages=MSG, max_tokens=80, temperature=1.0, seed=5, n=4, response_format=fmt)
    if not stream:
        texts = [c.message.content for c in client.chat.completions.create(**kw).choices]
    else:
        texts = [""] * 4
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
    assert len(texts) == 4
    for text in texts:
        _valid(text)


def test_the_sdk_parses_a_pydantic_model(client):
    reply = client.chat.completions.parse(model="tiny", messages=MSG, max_tokens=80, response_format=Person)
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_vllm_fields_on_completions_regex_choice_grammar_and_guided_aliases(client):
    def text(**extra) -> str:
        return client.completions.create(model="tiny", prompt="x", max_tokens=40, temperature=1.0, seed=2,
                                         extra_body=extra).choices[0].text

    import re
    assert re.fullmatch(r"[a-c]{4}-[0-9]", text(structured_outputs={"regex": "[a-c]{4}-[0-9]"}))
    assert text(structured_outputs={"choice": ["left", "right"]}) in ("left", "right")
    assert text(guided_choice=["up", "down"]) in ("up", "down")
    assert re.fullmatch(r"[xy]+!", text(guided_grammar='root ::= ("x" | "y")+ "!"') or "")
    _valid(client.completions.create(model="tiny", prompt="x", max_tokens=80,
                                     extra_body={"guided_json": SCHEMA}).choices[0].text)


def test_what_cannot_be_enforced_is_400_naming_the_field_and_the_server_serves_on(client, url):
    cases = [({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
             ({"response_format": {"type": "json_schema", "json_schema": {
                 "name": "x", "schema": {"type": "string", "pattern": "(?=a)"}}}}, "response_format", "look-around"),
             ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs", "GBNF"),
             ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
             ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
             ({"response_format": {"type": "xml"}}, "response_format", "json_schema")]
    for extra, param, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, extra_body=extra)
        assert info.value.param == param and words in info.value.message, (extra, info.value.message)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=3).usage.completion_tokens == 3


def test_tool_choice_named_required_auto_and_none(client):
    named = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    _valid(call.function.arguments, TOOLS[1]["function"]["parameters"])

    required = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
                                              max_tokens=300, parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "add") and calls[0].id.startswith("call_")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[calls[0].function.name]
    _valid(calls[0].function.arguments, schema)

    auto = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, max_tokens=300, seed=1,
                                          temperature=1.0)
    message, finish = auto.choices[0].message, auto.choices[0].finish_reason
    # The generic format (the embedded model's template has no tool syntax): a constrained reply that is either
    # calls of the request's tools, with valid arguments, or an answer taken out of {"response": ...}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if finish == "length":  # cut: the complete calls as tool_calls, or the answer so far, never the JSON around them
        assert not (message.content or "").startswith(('{"response":', '{"tool_calls":')), message.content[:40]
        for call in message.tool_calls or []:
            _valid(call.function.arguments, schemas[call.function.name])
    elif finish == "tool_calls":
        for call in message.tool_calls:
            _valid(call.function.arguments, schemas[call.function.name])
    else:
        assert finish == "stop" and message.tool_calls is None and isinstance(message.content, str)
        assert not message.content.startswith('{"response"')  # the answer, not the JSON around it

    none = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="none",
                                          max_tokens=5)
    assert none.choices[0].message.tool_calls is None and none.usage.completion_tokens == 5


def test_streamed_tool_calls_arrive_as_delta_tool_calls_and_results_go_back_in_the_history(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, stream=True,
                                                 max_tokens=60, tool_choice={"type": "function",
                                                                             "function": {"name": "get_weather"}}))
    deltas = [d for ch in chunks for c in ch.choices for d in (c.delta.tool_calls or [])]
    # the name and id once, then the arguments piece by piece, as OpenAI streams them (how many pieces depends on the
    # load: tokens made while the API process was busy go out in one delta)
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert all(d.index == 0 and d.function.name is None and d.id is None for d in deltas[1:])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    args = _valid("".join(d.function.arguments for d in deltas), TOOLS[0]["function"]["parameters"])
    history = MSG + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": deltas[0].id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": deltas[0].id, "content": "21 C"}]
    reply = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8)
    assert reply.usage.prompt_tokens > 0 and reply.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_tools_are_checked(client):
    for kw, param in [(dict(tools=[{"type": "function"}]), "tools"),
                      (dict(tool_choice="required"), "tool_choice"),
                      (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
                       "tool_choice"),
                      (dict(tools=TOOLS, tool_choice="required",
                            response_format={"type": "json_object"}), "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, **kw)
        assert info.value.param == param, (kw, info.value.message)


def test_constrained_and_plain_requests_in_flight_together(url):
    """24 concurrent requests, a third constrained by a schema, a third by tools, a third plain: every
    constrained reply validates, every plain one is 200 with its tokens."""
    async def one(aclient, i):
        if i % 3 == 0:
            r = await aclient.chat.completions.create(model="tiny", messages=MSG, max_tokens=80, temperature=1.0,
                                                      response_format={"type": "json_schema", "json_schema": {
                                                          "name": "p", "schema": SCHEMA}})
            _valid(r.choices[0].message.content)
        elif i % 3 == 1:
            r = await aclient.chat.completions.create(model="tiny", messages=MSG, max_tokens=60, tools=TOOLS,
                                                      tool_choice={"type": "function", "function": {"name": "add"}})
            _valid(r.choices[0].message.tool_calls[0].function.arguments, TOOLS[1]["function"]["parameters"])
        else:
            r = await aclient.completions.create(model="tiny", prompt=f"plain {i}", max_tokens=20)
            assert r.usage.completion_tokens == 20

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300) as a:
            await asyncio.gather(*(one(a, i) for i in range(24)))

    asyncio.run(run())
    assert httpx.get(url + "/health").status_code == 200


def test_langchain_structured_output_and_bind_tools(url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=url + "/v1", api_key="none", model="tiny", max_tokens=300, max_retries=0)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("who?")
        assert isinstance(person, Person), method
    reply = llm.bind_tools(TOOLS, tool_choice="add").invoke("add two numbers")
    (call,) = reply.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}


def test_instructor_tools_json_and_json_schema_modes(url):
    import instructor

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0),
                                        mode=mode)
        person = client.chat.completions.create(model="tiny", response_model=Person, messages=MSG,
                                                max_tokens=300, max_retries=0)
        assert isinstance(person, Person), mode


def test_litellm_tools(url, monkeypatch):
    # LiteLLM fetches its model price list from GitHub at import unless told to read the copy it ships: loopback only
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    reply = litellm.completion(model="openai/tiny", api_base=url + "/v1", api_key="none", messages=MSG,
                               tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                               max_tokens=60)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    _valid(call.function.arguments, TOOLS[0]["function"]["parameters"])
