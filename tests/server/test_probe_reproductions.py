"""Every reproduction of the reliability probe of 2026-12-06 (issue 48; docs/reliability.md, "Probe 3"), against
``conveyor serve`` as a user runs it: a subprocess on 127.0.0.1 in the default layout (the engine core in a process
of its own), on uvloop and on asyncio's loop. Each case asserts the answer the probe wanted, then that the server
still answers ``/health`` truthfully and an ordinary request within seconds (a wedged server answers neither, or
only ``/health``).

The model is a tiny random Llama (2 layers, hidden 64) with a byte-level tokenizer (so grammars see real text)
and a 4,096-token context, written by the test. One server per loop serves every case (``SharedServer``: a
server a case killed or wedged is replaced, so a failure does not cascade, and the replacement is counted).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.helpers.checkpoints import TINY_VOCAB, save_tiny_llama, write_byte_tokenizer
from tests.helpers.load import Served, SharedServer, assert_serving, idle, start_serve, tail, wait_gauges
from tests.helpers.server import CHAT_TEMPLATE

pytestmark = pytest.mark.slow  # real servers in subprocesses: run by CI, skipped by -m "not slow"

MODEL = "tiny"
MAX_MODEL_LEN = 4096
SERVE_FLAGS = ("--dtype", "float32", "--max-model-len", MAX_MODEL_LEN, "--num-kv-blocks", 8192,
               "--shutdown-timeout", 3, "--log-stats-interval", 5)
LOOPS = ["uvloop", "asyncio"]
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

@pytest.fixture(scope="session")
def probe_model_dir(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-probe"), max_position_embeddings=MAX_MODEL_LEN)
    write_byte_tokenizer(path, CHAT_TEMPLATE)
    return path

@pytest.fixture(scope="module", params=LOOPS)
def shared(request, probe_model_dir, tmp_path_factory):
    holder = SharedServer(probe_model_dir, tmp_path_factory.mktemp(f"probe-{request.param}"), "process",
                          request.param, SERVE_FLAGS, MODEL)
    yield holder
    holder.close()

@pytest.fixture
def srv(shared) -> Served:
    return shared.get()

def c(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}

def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": 4, **fields}

def assert_error(resp, status: int, param: str | None, srv: Served) -> dict:
    assert resp.status_code == status, f"{resp.status_code} {resp.text[:400]}" + tail(srv)
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error

# ---- N-1: an integer past 64 bits wedged the server for good ------------------------------------------------
# Each of these passed the API's checks and killed the API process's sender thread (OverflowError in msgspec's
# encoder): every later request hung while /health said 200, and SIGTERM did not end the process.
PAST_64_BITS = [
    ("stop_token_ids 10**30", C, c(stop_token_ids=[10**30]), "stop_token_ids"),
    ("stop_token_ids 2**64", C, c(stop_token_ids=[2**64]), "stop_token_ids"),
    ("chat stop_token_ids 10**30", CHAT, chat(stop_token_ids=[10**30]), "stop_token_ids"),
    ("top_k 10**30", C, c(top_k=10**30), "top_k"),
    ("chat top_k 10**30", CHAT, chat(top_k=10**30), "top_k"),
    ("kv_budget_tokens 10**30", C, c(kv_budget_tokens=10**30), "kv_budget_tokens"),
    ("prompt id 2**70", C, c(prompt=[1, 2**70]), "prompt"),
    ("batch prompt id -10**30", C, c(prompt=[[1, 2], [3, -10**30]]), "prompt"),
    ("allowed_token_ids 10**30", C, c(allowed_token_ids=[10**30]), "allowed_token_ids"),
    ("logit_bias key 10**30", C, c(logit_bias={str(10**30): 1.0}), "logit_bias"),
    ("chat logit_bias key 10**30", CHAT, chat(logit_bias={str(10**30): 1.0}), "logit_bias"),
    # bools are not numbers (the probe's Info): true was read as 1
    ("kv_budget_tokens true", C, c(kv_budget_tokens=True), "kv_budget_tokens"),
    ("n true", C, c(n=True), "n"),
    ("ignore_eos 'yes'", C, c(ignore_eos="yes"), "ignore_eos"),
]

@pytest.mark.parametrize("name,path,body,param", PAST_64_BITS, ids=[case[0] for case in PAST_64_BITS])
def test_an_integer_past_64_bits_is_400_and_nothing_wedges(srv, name, path, body, param):

    resp = httpx.post(srv.url + path, json=body, timeout=30)
    assert_error(resp, 400, param, srv)
    assert_serving(srv, MODEL)


# ---- N-1's other half: SIGTERM did not end the wedged server in 60 s ------------------------------------------
SHUTDOWN_TIMEOUT_S = 3  # SERVE_FLAGS' --shutdown-timeout
# What SIGTERM may take at most: the drain's deadline, then the engine's STOP_TIMEOUT_S (5 s) to exit before it is
# killed, and a few seconds for the rest of the shutdown.
EXIT_BOUND_S = SHUTDOWN_TIMEOUT_S + 5 + 4


@pytest.mark.parametrize("loop", LOOPS)
def test_sigterm_ends_the_server_within_the_drain_bound_even_with_a_frozen_engine(probe_model_dir, tmp_path, loop):
    """The engine process stops answering (SIGSTOP) with a stream in flight; SIGTERM must still end the server
    within the drain's deadline plus the engine's stop bound, the stream ending with [DONE], and no process left
    (before: the server waited 30 s for the engine to stop, on top of the drain)."""
    served = start_serve(str(probe_model_dir), tmp_path / "serve.log", loop=loop, extra=SERVE_FLAGS,
                         served_model_name=MODEL)
    engine = served.engine_process()
    try:
        with httpx.stream("POST", served.url + C, json=c(max_tokens=3000, ignore_eos=True, stream=True),
                          timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(engine.pid, signal.SIGSTOP)
            served.watch_exit()
            signalled = time.monotonic()
            served.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        exit_s = served.wait_exit(signalled, EXIT_BOUND_S + 30)  # waits past the bound, to tell late from never
        assert rest and rest[-1] == "data: [DONE]", rest[-3:]
        assert exit_s is not None and exit_s <= EXIT_BOUND_S, f"exit {exit_s} s after SIGTERM" + tail(served)
    finally:
        try:
            os.kill(engine.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        _, left = served.stop(timeout_s=10)
    assert not left, f"processes outlived conveyor serve: {left}"


# ---- N-7: an abandoned batch kept growing while the rest of it was submitted --------------------------------
SETTLE_S = 5.0  # issue 24's bound: gauges back to 0 this long after the client went away


def test_a_batch_abandoned_while_it_is_submitted_is_aborted_at_once(srv):
    """A non-streaming batch of 256 prompts of 1,000 tokens (each added to the engine in turn took a step's wait,
    so submitting it took seconds) abandoned 0.3 s after it was sent: every prompt already queued is aborted and
    the rest never are, so the gauges are back to 0 within 5 s of the hang-up (before: the handler watched for the
    disconnect only once all 256 were queued; the probe saw running grow 29 -> 63 and reach 0 19 s later)."""
    prompts = [f"{i:04d} " + "x" * 995 for i in range(256)]
    body = c(prompt=prompts, max_tokens=2000, ignore_eos=True)

    async def go() -> float:
        async with httpx.AsyncClient(base_url=srv.url, timeout=600) as client:
            task = asyncio.ensure_future(client.post(C, json=body))
            await asyncio.sleep(0.3)
            assert not task.done(), task.result().text[:300]
            task.cancel()  # the client gives up: httpx closes the connection
            await asyncio.gather(task, return_exceptions=True)
            return time.monotonic()

    left = asyncio.run(go())
    settled, last, trace = wait_gauges(srv.url, idle, SETTLE_S + 30, poll_s=0.1)
    took = time.monotonic() - left
    assert settled and took <= SETTLE_S + 1.0, (f"gauges {last} {took:.1f} s after the hang-up; trace "
                                                f"{trace[:2]} ... {trace[-2:]}") + tail(srv)
    assert_serving(srv, MODEL)
