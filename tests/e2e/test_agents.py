"""Agents on the default model (SmolLM2-135M-Instruct), each as its framework's users write one, against a real
server: LangChain's ``create_agent``, the OpenAI Agents SDK with its chat-completions model and with its Responses
model, pydantic-ai, LiteLLM with ``tools`` and ``tool_choice: "auto"``; and the tool-calling clients of the other
protocols (the ``anthropic`` SDK, the ``ollama`` client). Each run must call the tool with arguments that
validate, send its result back, and end with a text answer.

Before (main at 5052941, clients-2026-12-06.md): the model repeated its call until ``max_tokens``, the reply came
back as the raw ``{"tool_calls": ...`` envelope, and every framework took that text for the answer. Now a
repeated call ends the reply (``server/tool_parsers.py``), and a reply that repeats a call the conversation
already has the result of is generated again as an answer (``server/chat_run.py``).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from conveyor.server.app import build_app
from tests.helpers.server import running_server

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the weather in Paris?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def url(smollm2_llm):
    app = build_app(smollm2_llm.engine, None, None, log_stats_interval_s=0.0, shutdown_timeout_s=2.0)
    with running_server(app) as base:
        yield base


class Weather:
    """The one tool: records each call's arguments, answers with the weather."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, city: str) -> str:
        """Get the current weather in a city."""
        self.calls.append({"city": city})
        return f"It is 22 C and sunny in {city}."

    def assert_called_then_answered(self, answer) -> None:
        assert self.calls, "the tool was never called"
        for args in self.calls:
            jsonschema.validate(args, SCHEMA)
        assert isinstance(answer, str) and answer.strip(), f"no text answer: {answer!r}"
        assert not answer.lstrip().startswith("{"), f"the answer is a JSON envelope: {answer!r}"


def as_function(weather: Weather):
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return weather(city)

    return get_weather


def test_langchain_create_agent(url):
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    weather = Weather()
    llm = ChatOpenAI(base_url=url + "/v1", api_key="none", model=MODEL, temperature=0, max_tokens=200,
                     max_retries=0)
    agent = create_agent(llm, tools=[tool(as_function(weather))])
    messages = agent.invoke({"messages": [{"role": "user", "content": QUESTION}]}, {"recursion_limit": 8})["messages"]
    kinds = [type(m).__name__ for m in messages]
    assert "ToolMessage" in kinds and kinds[-1] == "AIMessage" and not messages[-1].tool_calls, kinds
    weather.assert_called_then_answered(messages[-1].content)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk(url, api):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no upload of traces to OpenAI: loopback only
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = (OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel)(MODEL, client)
    weather = Weather()
    agent = Agent(name="weather", instructions="Answer questions about the weather.", model=model,
                  tools=[function_tool(as_function(weather))],
                  model_settings=ModelSettings(temperature=0, max_tokens=200))
    result = Runner.run_sync(agent, QUESTION, max_turns=4)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem", kinds
    weather.assert_called_then_answered(result.final_output)


def test_pydantic_ai(url):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    weather = Weather()
    agent = Agent(OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=url + "/v1", api_key="none")),
                  tools=[as_function(weather)], model_settings={"temperature": 0, "max_tokens": 200})
    result = agent.run_sync(QUESTION)
    weather.assert_called_then_answered(result.output)


def test_litellm_tools_auto(url, monkeypatch):
    # LiteLLM fetches its model price list from GitHub at import unless told to read the copy it ships: loopback only
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather "
                                               "in a city.", "parameters": SCHEMA}}]
    weather, messages = Weather(), [{"role": "user", "content": QUESTION}]
    kwargs = dict(model=f"openai/{MODEL}", api_base=url + "/v1", api_key="none", tools=tools, tool_choice="auto",
                  temperature=0, max_tokens=200)
    first = litellm.completion(messages=messages, **kwargs).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.tool_calls
    messages.append(first.message.model_dump())
    for call in first.message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": weather(**json.loads(call.function.arguments))})
    second = litellm.completion(messages=messages, **kwargs).choices[0]
    assert second.finish_reason == "stop" and not second.message.tool_calls
    weather.assert_called_then_answered(second.message.content)


def test_anthropic_sdk_tool_round_trip(url):
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    tools = [{"name": "get_weather", "description": "Get the current weather in a city.", "input_schema": SCHEMA}]
    weather, messages = Weather(), [{"role": "user", "content": QUESTION}]
    first = client.messages.create(model=MODEL, max_tokens=200, tools=tools, messages=messages,
                                   extra_body={"temperature": 0})
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use"
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": weather(**call.input)}]}]
    second = client.messages.create(model=MODEL, max_tokens=200, tools=tools, messages=messages,
                                    extra_body={"temperature": 0})
    assert second.stop_reason == "end_turn"
    weather.assert_called_then_answered("".join(b.text for b in second.content if b.type == "text"))


def test_ollama_client_tool_round_trip(url):
    import ollama

    client = ollama.Client(host=url, timeout=120)
    weather, messages = Weather(), [{"role": "user", "content": QUESTION}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather "
                                               "in a city.", "parameters": SCHEMA}}]
    first = client.chat(model=f"{MODEL}:latest", messages=messages, tools=tools, options={"temperature": 0})
    (call,) = first.message.tool_calls
    messages += [first.message, {"role": "tool", "content": weather(**call.function.arguments),
                                 "tool_name": call.function.name}]
    second = client.chat(model=MODEL, messages=messages, tools=tools, options={"temperature": 0})
    assert not second.message.tool_calls
    weather.assert_called_then_answered(second.message.content)

