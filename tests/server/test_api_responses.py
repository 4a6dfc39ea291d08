"""The OpenAI Responses API through a real server with the official ``openai`` SDK, on the scripted model
(tests/helpers/scripted.py: it thinks ``ok`` and answers ``Paris``): string and item input, a function tool round
trip, ``previous_response_id``, streamed events reassembled by the SDK, ``text.format`` with a JSON schema, bad
input in OpenAI's error shape; and the store of past responses: bounded in rows and bytes, scoped by API key,
and still there after the server restarts (SQLite)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from conveyor.server.responses.store import ResponseStore
from tests.helpers.scripted import ANSWER, REASONING, WEATHER_SCHEMA, serve_scripted

pytestmark = pytest.mark.slow  # a real server

MODEL = "scripted"
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": WEATHER_SCHEMA, "strict": False}]
NO_THINKING = {"reasoning": {"effort": "none"}}


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("store") / "responses.sqlite3")


@pytest.fixture(scope="module")
def url(tmp_path_factory, store_path):
    store = ResponseStore(store_path, max_rows=5, max_bytes=1_000_000)
    with serve_scripted(tmp_path_factory.mktemp("scripted"), api_key=["k1", "k2"], responses_store=store) as base:
        yield base
    store.close()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0, timeout=60)


def test_string_input_answers_with_a_reasoning_item_and_a_message(client):
    response = client.responses.create(model=MODEL, input="Capital of France?", temperature=0)
    assert response.status == "completed" and response.output_text == ANSWER
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"] and response.output[0].content[0].text == REASONING
    assert response.usage.input_tokens > 0 and response.usage.output_tokens == 10
    plain = client.responses.create(model=MODEL, input="Capital?", temperature=0, instructions="Be brief.",
                                    **NO_THINKING)
    assert [item.type for item in plain.output] == ["message"] and plain.output_text == ANSWER
    cut = client.responses.create(model=MODEL, input="Capital?", max_output_tokens=3, **NO_THINKING)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_a_function_tool_round_trip_with_items_and_previous_response_id(client):
    first = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Weather in the capital?"}],
                                    tools=TOOLS, tool_choice="required", max_output_tokens=200, **NO_THINKING)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    # the result goes back in a follow-up that continues the stored conversation
    follow = client.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "12 C"}], **NO_THINKING)
    assert follow.output_text == ANSWER and follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens  # the earlier turn is in the prompt
    # the same round trip with the whole history as items, no store involved
    again = client.responses.create(model=MODEL, store=False, tools=TOOLS, **NO_THINKING, input=[
        {"role": "user", "content": "Weather in the capital?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}], tool_choice="none")
    assert again.output_text == ANSWER and again.usage.input_tokens == follow.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(again.id)  # store: false


def test_namespaced_tools_are_called_by_their_namespace(client):
    """Codex groups tools in namespaces: a call names its namespace, and comes back in the history with it."""
    grouped = [{"type": "namespace", "name": "weather", "description": "weather tools",
                "tools": [{"type": "function", "name": "get", "parameters": WEATHER_SCHEMA, "strict": False}]}]
    first = client.responses.create(model=MODEL, input="Weather?", tools=grouped, tool_choice="required",
                                    max_output_tokens=200, **NO_THINKING)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.namespace, call.name) == ("weather", "get")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    answer = client.responses.create(model=MODEL, store=False, tools=grouped, tool_choice="none", **NO_THINKING,
                                     input=[{"role": "user", "content": "Weather?"}, call.model_dump(),
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": "12 C"}])
    assert answer.output_text == ANSWER


def test_streamed_events_reassemble_into_the_same_response(client):
    whole = client.responses.create(model=MODEL, input="Capital of France?", temperature=0)
    with client.responses.stream(model=MODEL, input="Capital of France?", temperature=0) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert streamed.output_text == whole.output_text == ANSWER
    assert [i.type for i in streamed.output] == ["reasoning", "message"]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    # at least one delta each: tokens made while the API process was busy go out in one delta (a loaded machine)
    assert kinds.count("response.output_text.delta") >= 1 and kinds.count("response.reasoning_text.delta") >= 1
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    with client.responses.stream(model=MODEL, input="Weather?", tools=TOOLS, **NO_THINKING,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        kinds = [event.type for event in stream]
        call = stream.get_final_response().output[0]
    assert "response.function_call_arguments.delta" in kinds and json.loads(call.arguments) == {"city": "Oslo"}


def test_text_format_json_schema_is_enforced(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    response = client.responses.create(model=MODEL, input="Where?", max_output_tokens=60, **NO_THINKING,
                                       text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), {**schema, "additionalProperties": False})


def test_the_store_is_scoped_by_key_and_bounded_in_rows(client, url):
    kept = client.responses.create(model=MODEL, input="Capital?", **NO_THINKING)
    assert client.responses.retrieve(kept.id).output_text == ANSWER
    other = openai.OpenAI(base_url=url + "/v1", api_key="k2", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(kept.id)  # another key's response does not exist for this key
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input="and?", previous_response_id=kept.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(kept.id)
    items = httpx.get(f"{url}/v1/responses/{kept.id}/input_items", headers={"Authorization": "Bearer k1"}).json()
    assert items["data"][0]["content"] == "Capital?"
    for _ in range(5):  # the store keeps 5 rows: the oldest go first
        client.responses.create(model=MODEL, input="Capital?", **NO_THINKING)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    latest = client.responses.create(model=MODEL, input="Capital?", **NO_THINKING)
    client.responses.delete(latest.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(latest.id)


BAD = [  # (body fields, the param the 400 names)
    ({"input": 3}, "input"), ({"input": [{"type": "image", "url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"), ({"tool_choice": "required"}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"), ({"temperature": "hot"}, "temperature"),
    ({"temperature": 9.0}, "temperature"), ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"background": True}, "background"), ({"store": "yes"}, "store"), ({"model": "gpt-5"}, "model"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_input_is_a_4xx_in_openais_shape_and_the_server_serves_on(client, url, fields, param):
    resp = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "hi", **fields},
                      headers={"Authorization": "Bearer k1"}, timeout=60)
    error = resp.json()["error"]
    assert resp.status_code in (400, 404) and error["param"] == param, resp.text
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).status == "incomplete"


def test_stored_responses_survive_a_restart(tmp_path):
    """A second server on the same SQLite file finds what the first stored (and another key still does not)."""
    path = str(tmp_path / "responses.sqlite3")
    with serve_scripted(tmp_path / "m1", api_key=["k1", "k2"], responses_store=ResponseStore(path)) as base:
        first = openai.OpenAI(base_url=base + "/v1", api_key="k1", max_retries=0).responses.create(
            model=MODEL, input="Capital?", **NO_THINKING)
    with serve_scripted(tmp_path / "m2", api_key=["k1", "k2"], responses_store=ResponseStore(path)) as base:
        again = openai.OpenAI(base_url=base + "/v1", api_key="k1", max_retries=0)
        assert again.responses.retrieve(first.id).output_text == ANSWER
        follow = again.responses.create(model=MODEL, input="And of Italy?", previous_response_id=first.id,
                                        **NO_THINKING)
        assert follow.status == "completed"
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(base_url=base + "/v1", api_key="k2", max_retries=0).responses.retrieve(first.id)


def test_the_store_bounds_bytes_and_keeps_keys_apart(tmp_path):
    store = ResponseStore(str(tmp_path / "s.sqlite3"), max_rows=100, max_bytes=2_000)
    big = {"id": "resp_big", "output": "x" * 3_000}
    assert not store.put("a", big, [], []) and store.get("a", "resp_big") is None  # alone over the bound
    for i in range(6):
        assert store.put("a", {"id": f"resp_{i}", "output": "y" * 400}, [], [])
    rows, size = store.usage()
    assert size <= 2_000 and rows < 6 and store.get("a", "resp_0") is None and store.get("a", "resp_5")
    assert store.get("b", "resp_5") is None and not store.delete("b", "resp_5") and store.delete("a", "resp_5")
    store.close()
