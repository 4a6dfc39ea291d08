"""The Anthropic Messages API through a real server, with Anthropic's own SDK and LangChain's ChatAnthropic, on the
scripted model (tests/helpers/scripted.py): it thinks ``ok`` and answers ``Paris``, deterministically, so every
field of the reply can be checked. Bad input is a 4xx in Anthropic's error shape and the server serves on."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.helpers.scripted import ANSWER, REASONING, WEATHER_SCHEMA, serve_scripted

pytestmark = pytest.mark.slow  # a real server

MODEL = "scripted"
ASK = [{"role": "user", "content": "Capital of France?"}]
TOOLS = [{"name": "get_weather", "description": "the weather in a city", "input_schema": WEATHER_SCHEMA}]
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK no longer takes sampling fields as arguments


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serve_scripted(tmp_path_factory.mktemp("scripted"), api_key=["k1", "k2"]) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key="k1", max_retries=0, timeout=60)


def test_create_answers_and_thinks_only_when_asked(client):
    reply = client.messages.create(model=MODEL, max_tokens=20, messages=ASK, **GREEDY)
    assert [(b.type, b.text) for b in reply.content] == [("text", ANSWER)]
    assert (reply.role, reply.stop_reason, reply.stop_sequence, reply.model) == ("assistant", "end_turn", None, MODEL)
    assert reply.usage.input_tokens > 0 and reply.usage.output_tokens == len(ANSWER) + 1  # + the end of turn
    thinking = client.messages.create(model=MODEL, max_tokens=40, messages=ASK, system="Be brief.",
                                      thinking={"type": "enabled", "budget_tokens": 1024}, **GREEDY)
    assert [b.type for b in thinking.content] == ["thinking", "text"]
    assert (thinking.content[0].thinking, thinking.content[1].text) == (REASONING, ANSWER)


def test_stream_is_anthropics_event_sequence(client, url):
    with client.messages.stream(model=MODEL, max_tokens=40, messages=ASK, thinking={"type": "enabled",
                                "budget_tokens": 1024}, **GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", REASONING), ("text", ANSWER)]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and final.stop_reason == "end_turn"
    # the raw wire: event names, a ping, blocks opened and closed in order, the stop reason in message_delta
    with httpx.stream("POST", url + "/v1/messages", headers={"x-api-key": "k2"}, timeout=60, json={
            "model": MODEL, "max_tokens": 20, "messages": ASK, "stream": True, "temperature": 0}) as resp:
        names = [line[7:] for line in resp.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names[2] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[3:-3]) == {"content_block_delta"}  # the text: one delta or more, as the load lets


def test_tool_use_streamed_and_a_round_trip(client):
    reply = client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "any"}, **GREEDY)
    (call,) = reply.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Oslo"}
    assert reply.stop_reason == "tool_use"
    with client.messages.stream(model=MODEL, max_tokens=60, messages=ASK, tools=TOOLS, **GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        kinds = {e.type for e in stream}
        streamed = stream.get_final_message()
    assert "input_json" in kinds and streamed.content[0].input == {"city": "Oslo"}
    history = ASK + [{"role": "assistant", "content": reply.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": [{"type": "text", "text": "12 C"}]}]}]
    answer = client.messages.create(model=MODEL, max_tokens=20, messages=history, tools=TOOLS, **GREEDY,
                                    tool_choice={"type": "none"})
    assert answer.content[0].text == ANSWER and answer.stop_reason == "end_turn"


def test_stop_sequences_and_count_tokens(client):
    reply = client.messages.create(model=MODEL, max_tokens=20, messages=ASK, stop_sequences=["ri"], **GREEDY)
    assert (reply.content[0].text, reply.stop_reason, reply.stop_sequence) == ("Pa", "stop_sequence", "ri")
    cut = client.messages.create(model=MODEL, max_tokens=2, messages=ASK, **GREEDY)
    assert (cut.content[0].text, cut.stop_reason) == ("Pa", "max_tokens")
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS)
    used = client.messages.create(model=MODEL, max_tokens=1, messages=ASK, tools=TOOLS, **GREEDY)
    assert counted.input_tokens == used.usage.input_tokens > 0


def test_langchain_chat_anthropic(url):
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model=MODEL, base_url=url, api_key="k1", max_tokens=20, temperature=0, max_retries=0)
    assert llm.invoke("Capital of France?").content == ANSWER
    call = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("Weather?").tool_calls[0]
    assert call["name"] == "get_weather" and call["args"] == {"city": "Oslo"}


BAD = [  # (body fields, what the message names)
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"temperature": 1.5}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages"), ({"stop_sequences": "x"}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]},
     "tool_result"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]}, "tools"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}],
      "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
]


@pytest.mark.parametrize("fields,named", BAD, ids=[n for _, n in BAD])
def test_bad_input_is_a_400_in_anthropics_shape_and_the_server_serves_on(client, url, fields, named):
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, **fields}
    resp = httpx.post(url + "/v1/messages", json={k: v for k, v in body.items() if v is not None},
                      headers={"x-api-key": "k1"}, timeout=60)
    error = resp.json()
    assert resp.status_code == 400 and error["type"] == "error", resp.text
    assert error["error"]["type"] == "invalid_request_error" and named in error["error"]["message"], error
    assert client.messages.create(model=MODEL, max_tokens=2, messages=ASK).content  # still serving


def test_keys_unknown_models_and_bad_json_in_anthropics_shape(url):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="k3", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=ASK)
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=url, api_key="k2", max_retries=0).messages.create(
            model="claude-sonnet-4-5", max_tokens=2, messages=ASK)
    resp = httpx.post(url + "/v1/messages", content=b"{not json", headers={"x-api-key": "k1",
                                                                           "content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
