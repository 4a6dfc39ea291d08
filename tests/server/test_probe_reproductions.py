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
import json
import os
import signal
import time

import httpx
import pytest

from tests.helpers.checkpoints import save_tiny_llama, write_byte_tokenizer
from tests.helpers.load import Served, SharedServer, assert_serving, idle, tail, wait_gauges
from tests.helpers.server import CHAT_TEMPLATE

pytestmark = pytest.mark.slow  # real servers in subprocesses: run by CI, skipped by -m "not slow"

MODEL = "tiny"
MAX_MODEL_LEN = 4096
CHECK_TIMEOUT_S = 5  # --grammar-check-timeout (10 by default): N-4's schema is refused within it
SERVE_FLAGS = ("--dtype", "float32", "--max-model-len", MAX_MODEL_LEN, "--num-kv-blocks", 8192,
               "--shutdown-timeout", 3, "--log-stats-interval", 5, "--grammar-check-timeout", CHECK_TIMEOUT_S)
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


# ---- N-2: a constraint with top logprobs: -inf is not JSON ---------------------------------------------------
def strict_json(text: str):
    """JSON as a strict parser reads it: NaN / Infinity / -Infinity are errors."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
LOGPROBS_WITH_A_CONSTRAINT = [
    ("completions guided_choice, logprobs 5", C, c(guided_choice=["yes", "no"], logprobs=5, max_tokens=10)),
    ("completions guided_choice, echo, logprobs 3", C, c(guided_choice=["yes", "no"], logprobs=3, echo=True,
                                                         max_tokens=10)),
    ("chat json_schema, top_logprobs 5", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": SCHEMA}}, logprobs=True, top_logprobs=5, max_tokens=20)),
    ("chat json_schema, top_logprobs 5, n 4", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": SCHEMA}}, logprobs=True, top_logprobs=5, max_tokens=20, n=4)),
    ("chat named tool, top_logprobs 3", CHAT, chat(tools=[TOOL], tool_choice={"type": "function", "function": {
        "name": "pick"}}, logprobs=True, top_logprobs=3, max_tokens=20)),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name,path,body", LOGPROBS_WITH_A_CONSTRAINT, ids=[x[0] for x in LOGPROBS_WITH_A_CONSTRAINT])
def test_logprobs_of_masked_tokens_are_valid_json(srv, name, path, body, stream):
    """Masked tokens' logprob is -inf: answered as vLLM does, -9999.0, in strict JSON, streamed or not (before:
    400 "Out of range float values are not JSON compliant" after the whole generation, or -Infinity in a chunk)."""
    resp = httpx.post(srv.url + path, json={**body, "stream": stream}, timeout=120)
    assert resp.status_code == 200, resp.text[:400] + tail(srv)
    if stream:
        chunks = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert chunks[-1] == "[DONE]"
        parsed = [strict_json(chunk) for chunk in chunks[:-1]]
        assert not any("error" in p for p in parsed), parsed[-1]
        text = json.dumps(parsed)
    else:
        text = json.dumps(strict_json(resp.text))
    if not (stream and "tool_choice" in body):  # a named tool's streamed arguments carry no logprobs
        assert "-9999.0" in text  # at least one masked alternative among the top logprobs, in vLLM's form
    assert_serving(srv, MODEL)


# ---- N-3, N-4, N-6: constraints that cannot run are refused before they do ----------------------------------
def optional_properties(count: int) -> dict:
    """The probe's N-4 schema: one object of ``count`` optional properties (compile time grows as its square;
    llguidance panics past about 11,000)."""
    types = ["string", "integer", "number", "boolean"]
    return {"type": "object", "properties": {f"field_number_{i:05d}": {"type": types[i % 4], "description":
                                                                        "a generated property"} for i in range(count)}}


REFUSED_CONSTRAINTS = [
    # N-3: llguidance's limits, hit at the first tokens (before: 500 request_failed mid-generation)
    ("guided_choice of 10,000 strings", C, c(guided_choice=[f"c{i}" for i in range(10_000)]), "guided_choice"),
    ("a Lark grammar of 3,000 alternatives", C,
     c(guided_grammar="start: " + " | ".join(f'"x{i}"' for i in range(3000))), "guided_grammar"),
    ('GBNF root ::= "a" root', C, c(guided_grammar='root ::= "a" root'), "guided_grammar"),
    ("regex ((a|aa){50}){50}", C, c(guided_regex="((a|aa){50}){50}"), "guided_regex"),
    ("JSON schema pattern ^a{1000}{1000}$", C, c(guided_json={"type": "string", "pattern": "^a{1000}{1000}$"}),
     "guided_json"),
    ("guided_choice with min_tokens 50", C, c(guided_choice=["yes", "no"], min_tokens=50, max_tokens=60),
     "min_tokens"),
    # N-6: grammars that match no text (before: 200 with "" and finish_reason stop)
    ("a $ref cycle", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}),
     "response_format"),
    ("a self $ref", C, c(guided_json={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}), "guided_json"),
    ("GBNF x ::= x", C, c(guided_grammar="root ::= x\nx ::= x"), "guided_grammar"),
]
LEAKS = ("panic", "backtrace", "Traceback", ".rs:", ".c:", "/tmp/", "site-packages")


@pytest.mark.parametrize("name,path,body,param", REFUSED_CONSTRAINTS, ids=[x[0] for x in REFUSED_CONSTRAINTS])
def test_a_constraint_that_cannot_run_is_400_before_it_runs(srv, name, path, body, param):
    resp = httpx.post(srv.url + path, json=body, timeout=120)
    error = assert_error(resp, 400, param, srv)
    assert not any(leak in error["message"] for leak in LEAKS), error["message"]
    assert_serving(srv, MODEL)


def test_a_schema_that_compiles_for_a_minute_is_refused_in_time_and_holds_up_nobody(srv):
    """N-4: a 1 MB schema of 12,000 optional properties compiled for 27-65 s on the engine's grammar thread, then
    panicked, and the 500 carried the Rust backtrace with file paths. Now its check runs in a worker process that is
    killed at --grammar-check-timeout (5 s here) or reports the panic as a sentence: a 400 naming the field within
    the bound, nothing native in it; meanwhile another constrained request (the other worker) and a plain one are
    served."""
    big = chat(response_format={"type": "json_schema", "json_schema": {"name": "big", "schema":
                                                                        optional_properties(12_000)}})
    small = chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
                 max_tokens=20)

    async def go():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            started = time.monotonic()
            refused = asyncio.ensure_future(client.post(CHAT, json=big))
            await asyncio.sleep(0.5)  # its check is under way
            others = await asyncio.gather(client.post(CHAT, json=small), client.post(C, json=c()))
            others_s = time.monotonic() - started
            answer = await refused
            return answer, time.monotonic() - started, others, others_s

    answer, refused_s, others, others_s = asyncio.run(go())
    error = assert_error(answer, 400, "response_format", srv)
    assert not any(leak in error["message"] for leak in LEAKS), error["message"]
    assert refused_s <= CHECK_TIMEOUT_S + 30, refused_s  # the bound, and generous room for a loaded machine
    assert [o.status_code for o in others] == [200, 200], [o.text[:200] for o in others]
    strict_json(others[0].json()["choices"][0]["message"]["content"])
    assert others_s < refused_s or refused_s < CHECK_TIMEOUT_S, (others_s, refused_s)
    assert_serving(srv, MODEL)


# ---- N-5: malformed tool histories -----------------------------------------------------------------------------
def history(tool_calls) -> list[dict]:
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": tool_calls},
            {"role": "tool", "tool_call_id": "c", "content": "sunny"}]


MALFORMED_TOOLS = [
    ("a tool call without function", chat(messages=history([{"id": "c", "type": "function"}])), "messages",
     "messages.1.tool_calls.0.function"),
    ("tool_calls a string", chat(messages=history("get_weather")), "messages", "messages.1.tool_calls"),
    ("tool_calls holding strings", chat(messages=history(["get_weather"])), "messages", "messages.1.tool_calls.0"),
    ("function a string", chat(messages=history([{"id": "c", "type": "function", "function": "get_weather"}])),
     "messages", "messages.1.tool_calls.0.function"),
    ("a function without name", chat(messages=history([{"id": "c", "type": "function",
                                                        "function": {"arguments": "{}"}}])),
     "messages", "messages.1.tool_calls.0.function.name"),
    ("the same, with tools", chat(messages=history([{"id": "c", "type": "function"}]), tools=[TOOL]), "messages",
     "messages.1.tool_calls.0.function"),
    ("tool_choice with a string function", chat(tools=[TOOL], tool_choice={"type": "function", "function": "pick"}),
     "tool_choice", "tool_choice"),
    ("tool_choice of another type", chat(tools=[TOOL], tool_choice={"type": "tool", "function": {"name": "pick"}}),
     "tool_choice", "tool_choice"),
]


@pytest.mark.parametrize("name,body,param,where", MALFORMED_TOOLS, ids=[x[0] for x in MALFORMED_TOOLS])
def test_a_malformed_tool_history_is_400_naming_the_message_and_field(srv, name, body, param, where):
    """Before: 500 internal error: KeyError('function') (AttributeError for the string function), a traceback in
    the log."""
    resp = httpx.post(srv.url + CHAT, json=body, timeout=60)
    error = assert_error(resp, 400, param, srv)
    assert error["message"].startswith(where), error["message"]
    assert_serving(srv, MODEL)


def test_a_well_formed_tool_history_is_served(srv):
    body = chat(messages=history([{"id": "c", "type": "function", "function": {"name": "pick",
                                                                               "arguments": '{"x": "a"}'}}]),
                tools=[TOOL], tool_choice={"type": "function", "function": {"name": "pick"}}, max_tokens=20)
    resp = httpx.post(srv.url + CHAT, json=body, timeout=60)
    assert resp.status_code == 200, resp.text[:300]
    (call,) = resp.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "pick" and json.loads(call["function"]["arguments"])["x"] in ("a", "b")


# ---- N-1's other half: SIGTERM did not end the wedged server in 60 s (last: it ends the shared server) -------
SHUTDOWN_TIMEOUT_S = 3  # SERVE_FLAGS' --shutdown-timeout
# What SIGTERM may take at most: the drain's deadline, then the engine's STOP_TIMEOUT_S (5 s) to exit before it is
# killed, and a few seconds for the rest of the shutdown.
EXIT_BOUND_S = SHUTDOWN_TIMEOUT_S + 5 + 4


def test_sigterm_ends_the_server_within_the_drain_bound_even_with_a_frozen_engine(shared):
    """The engine process stops answering (SIGSTOP) with a stream in flight; SIGTERM must still end the server
    within the drain's deadline plus the engine's stop bound, the stream ending with [DONE], and no process left
    (before: the server waited 30 s for the engine to stop, on top of the drain). The module's last case on each
    loop: it ends the shared server."""
    served = shared.get()
    shared.served = None  # this case stops it
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
        print(f"SIGTERM with a frozen engine ({shared.loop}): exit {exit_s} s after the signal")
        assert rest and rest[-1] == "data: [DONE]", rest[-3:]
        assert exit_s is not None and exit_s <= EXIT_BOUND_S, f"exit {exit_s} s after SIGTERM" + tail(served)
    finally:
        try:
            os.kill(engine.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        _, left = served.stop(timeout_s=10)
    assert not left, f"processes outlived conveyor serve: {left}"
