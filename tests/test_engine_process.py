"""The engine core in its own process, as ``conveyor serve`` runs it: a real uvicorn and the ``openai`` client in
front of ``EngineCoreClient``; abort frees the KV cache; a killed engine process fails in-flight streams and stops
the server; output deltas rebuild exactly what the engine produced."""

from __future__ import annotations

import multiprocessing
import random
import shutil
import threading
import time

import httpx
import openai
import pytest

from conveyor import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.core_client import EngineCoreClient
from conveyor.engine.core_proc import serve_engine
from conveyor.engine.output_delta import DeltaDecoder, DeltaEncoder, snapshot
from conveyor.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from conveyor.server.app import build_app
from tests.helpers.server import TEST_DTYPE, make_engine, running_server

PROMPT_IDS = [5, 6, 7, 8, 9, 10]


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.slow
def test_the_served_process_engine_streams_aborts_and_dies_loudly(tiny_chat_dir):
    # What an engine in this process answers, greedy: the process engine must answer the same.
    offline = make_engine(tiny_chat_dir)
    offline.add_request("ref", {"prompt_token_ids": PROMPT_IDS}, SamplingParams(temperature=0.0, max_tokens=12))
    final = None
    while offline.has_unfinished_requests():
        final = next((out for out in offline.step() if out.finished), final)
    expected, num_tokens = final.outputs[0].text, len(final.outputs[0].token_ids)

    args = EngineArgs(model=str(tiny_chat_dir), dtype=TEST_DTYPE, num_kv_blocks=256, block_size=16,
                      debug_invariants=True)
    core = EngineCoreClient(args)
    app = build_app(core, "tiny", log_stats_interval_s=0.0, shutdown_timeout_s=2.0)
    with running_server(app, exit_on_engine_death=False) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        whole = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=12, temperature=0.0)
        assert whole.choices[0].text == expected and whole.usage.completion_tokens == num_tokens
        pieces = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=12, temperature=0.0,
                                           stream=True)
        assert "".join(chunk.choices[0].text for chunk in pieces if chunk.choices) == expected
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1 w2"}],
                                              max_tokens=4, temperature=0.0)
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
        assert httpx.post(url + "/tokenize", json={"prompt": "w1 w2"}).json()["count"] > 0
        assert "conveyor:generation_tokens_total" in httpx.get(url + "/metrics").text

        # A client that leaves mid-stream: its request is aborted and its blocks are freed.
        body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200, resp.read()
            events = (line for line in resp.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                assert "[DONE]" not in next(events)
            assert core.stats.num_running == 1 and core.stats.kv_cache_usage > 0
        assert wait_until(lambda: core.num_in_flight == 0 and core.stats.num_running == 0
                          and core.stats.kv_cache_usage == 0.0)

        # The engine process is killed mid-stream: the stream ends with engine_dead, and so does /health.
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) == 2:
                        core._proc.kill()
        assert lines[-1] == "[DONE]" and '"engine_dead"' in lines[-2]
        assert httpx.get(url + "/health").status_code == 503
        assert "exited with code -9" in str(core.dead_error)


@pytest.mark.slow
def test_an_engine_that_raises_says_so_and_stops(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)

    def crash():
        raise RuntimeError("injected engine fault")

    engine.step = crash
    server_end, engine_end = multiprocessing.Pipe()
    result = []
    thread = threading.Thread(target=lambda: result.append(serve_engine(engine, engine_end)))
    thread.start()
    server_end.send(("call", 0, _add_one))
    kinds = []
    while server_end.poll(30):
        kind, payload = server_end.recv()
        kinds.append(kind)
        if kind == "dead":
            assert "injected engine fault" in payload
            break
    thread.join(30)
    assert kinds[-1] == "dead" and result == [1]


def _add_one(engine):
    engine.add_request("a", {"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=3))


@pytest.mark.slow
def test_an_engine_that_cannot_load_its_model_is_an_error_at_once(tiny_llama_dir, tmp_path):
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_llama_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(Exception) as in_process:  # what an engine in this process raises ...
        make_engine(broken)
    with pytest.raises(type(in_process.value)) as in_its_own:  # ... the engine process's client raises too
        EngineCoreClient(EngineArgs(model=str(broken)), startup_timeout_s=120).wait_ready()
    assert str(in_its_own.value) == str(in_process.value) and "safetensors" in str(in_its_own.value)


@pytest.mark.parametrize("seed", range(5))
def test_deltas_rebuild_every_cumulative_output(seed):
    rng = random.Random(seed)
    out = RequestOutput("r", "p", [1, 2, 3], [CompletionOutput(0, logprobs=[]), CompletionOutput(1)],
                        RequestMetrics(0.0))
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    for step in range(30):
        for c in out.outputs:
            if c.finished:
                continue
            c.token_ids.append(rng.randrange(100))
            c.token_times.append(float(step))
            if c.logprobs is not None:
                c.logprobs.append(("lp", step))
            c.text += rng.choice(["a", "bc", "", " d"])
            if rng.random() < 0.2:  # a stop string found: the text's tail is cut
                c.text = c.text[: rng.randrange(len(c.text) + 1)]
            if step == 29 or rng.random() < 0.05:
                c.finish_reason = "stop"
        out.metrics.last_token_time = float(step)
        out.finished = all(c.finished for c in out.outputs)
        rebuilt = decoder.decode(encoder.encode(snapshot(out)))
        assert rebuilt == out
        if out.finished:
            break
