"""The engine core in its own process, as ``conveyor serve`` runs it: a real uvicorn and the ``openai`` client in
front of ``EngineCoreClient``; abort frees the KV cache; a killed engine process fails in-flight streams and stops
the server; output deltas rebuild exactly what the engine produced."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import threading
import time

import httpx
import msgspec
import openai
import pytest
import zmq

from conveyor import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.core_client import EngineCoreClient
from conveyor.engine import ipc
from conveyor.engine.core_proc import serve_engine
from conveyor.engine.core_step import CoreStepOutput
from conveyor.engine.engine_client import ServedEngine
from conveyor.engine.output_processor import OutputProcessor
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
    # The facts came with "ready" from the engine process, and are the engine's.
    assert isinstance(core, ServedEngine) and core.info.pid != os.getpid()
    assert (core.info.max_model_len, core.info.num_kv_blocks) == (offline.max_model_len, 256)
    assert core.info.encode("w1 w2") == offline.encode("w1 w2") and not core.info.random_weights
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

    engine.core_step = crash
    with engine_core_on_sockets(engine) as (send, from_engine, result):
        send(ipc.AddRequest(0, "a", PROMPT_IDS, SamplingParams(max_tokens=3), time.monotonic()))
        decoder, messages = ipc.message_decoder(), []
        while from_engine.poll(30_000):
            messages.append(decoder.decode(from_engine.recv()))
            if messages[-1].dead is not None:
                break
        assert wait_until(lambda: result == [1])
    assert [r.call_id for m in messages for r in m.replies] == [0]  # the add was answered first
    assert messages[-1].dead is not None and "injected engine fault" in messages[-1].dead


@contextlib.contextmanager
def engine_core_on_sockets(engine):
    """``serve_engine`` in a thread, with this test as its API process: (send a request, the output socket)."""
    endpoints = ipc.Endpoints.fresh()
    context = zmq.Context()
    to_engine = ipc.make_socket(context, zmq.PUSH, endpoints.input, bind=True)
    from_engine = ipc.make_socket(context, zmq.PULL, endpoints.output, bind=True, hwm=ipc.OUTPUT_HWM)
    api_end, engine_end = multiprocessing.Pipe()
    result = []
    thread = threading.Thread(target=lambda: result.append(serve_engine(engine, engine_end, endpoints)))
    thread.start()
    try:
        yield (lambda request: to_engine.send(msgspec.msgpack.encode(request))), from_engine, result
    finally:
        if thread.is_alive():
            to_engine.send(msgspec.msgpack.encode(ipc.Shutdown()))
        while thread.is_alive():  # drain, so the engine's last messages can leave
            if from_engine.poll(100):
                from_engine.recv()
        to_engine.close(linger=0)
        from_engine.close(linger=0)
        context.term()
        endpoints.remove()
        api_end.close()


@pytest.mark.slow
def test_an_api_side_that_stops_reading_makes_the_engine_wait(tiny_llama_dir):
    # Back-pressure: nothing on the output path grows without bound. While nobody reads, the engine steps only
    # until the bounded queues are full; once read again, it goes on and finishes.
    engine = make_engine(tiny_llama_dir)
    with engine_core_on_sockets(engine) as (send, from_engine, _):
        for i in range(4):
            send(ipc.AddRequest(i, f"r{i}", PROMPT_IDS, SamplingParams(max_tokens=400, ignore_eos=True),
                                time.monotonic()))
        assert wait_until(lambda: engine.scheduler.num_steps > 0)
        steps = -1
        while steps != engine.scheduler.num_steps:  # stalls within a few seconds (fast steps, small queues)
            steps = engine.scheduler.num_steps
            time.sleep(1.0)
        assert steps < 400, "the engine ran every step although nobody read its output"
        decoder, finished = ipc.message_decoder(), set()
        while len(finished) < 4 and from_engine.poll(30_000):
            step = decoder.decode(from_engine.recv()).step
            finished |= {o.request_id for o in (step.outputs if step else []) if o.finish_reason is not None}
        assert finished == {"r0", "r1", "r2", "r3"} and engine.scheduler.num_steps >= 400


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


@pytest.mark.slow
def test_the_core_steps_sent_over_the_pipe_give_what_an_engine_in_this_process_gives(tiny_chat_dir):
    # The engine core process's path without the process: core_step() -> msgpack -> this process's
    # OutputProcessor (stop strings sent back as finishes), against LLMEngine.step(): the same outputs.
    local = make_engine(tiny_chat_dir)
    local.add_request("probe", {"prompt_token_ids": [9, 10, 11]}, SamplingParams(temperature=0.0, max_tokens=12,
                                                                                    ignore_eos=True))
    probe = None
    while local.has_unfinished_requests():
        probe = next((o for o in local.step() if o.finished), probe)
    stop_word = probe.outputs[0].text.split()[3]  # a stop string its greedy text meets after a few tokens
    requests = [
        ("plain", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=12)),
        ("stop", [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop_word])),
        ("n3", [12, 13], SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=10, logprobs=2)),
        ("scored", [20, 21, 22, 23], SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=1)),
    ]
    core = make_engine(tiny_chat_dir)
    processor = OutputProcessor(core.tokenizer)
    decoder = msgspec.msgpack.Decoder(CoreStepOutput)
    for rid, ids, params in requests:
        local.add_request(rid, {"prompt_token_ids": ids}, params, arrival_time=0.0)
        children = core.add_core_request(rid, ids, params, 0.0)
        processor.add(rid, None, ids, children, 0.0)
    expected, got = {}, {}
    while local.has_unfinished_requests():
        expected.update((o.request_id, o) for o in local.step() if o.finished)
    while core.has_unfinished_requests():
        step = core.core_step()
        if step is None:
            continue
        states = processor.settle(processor.process(decoder.decode(msgspec.msgpack.encode(step))),
                                  core.finish_requests, step.time)
        got.update((o.request_id, o) for o in processor.emit(states) if o.finished)
    assert set(got) == set(expected) == {rid for rid, _, _ in requests}
    for rid in expected:
        a, b = expected[rid], got[rid]
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in a.outputs] == \
               [(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in b.outputs]
        assert a.prompt_logprobs == b.prompt_logprobs
    assert got["stop"].outputs[0].finish_reason == "stop" and got["stop"].outputs[0].stop_reason == stop_word
    assert processor.num_late_tokens == 0 and not processor.parents and core.kv_manager.usage() == 0.0
