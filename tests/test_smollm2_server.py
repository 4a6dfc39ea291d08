"""The default model served over HTTP, as a new user meets it: chat completions through the model's template that
stop at its end-of-turn token, and ``conveyor chat --url`` keeping a conversation. The server runs on the
session's SmolLM2 engine and stops when this module ends."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from conveyor.server.app import build_app
from server_helpers import running_server

pytestmark = pytest.mark.slow


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
