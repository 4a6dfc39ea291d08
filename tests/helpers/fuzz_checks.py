"""schemathesis checks for tests/server/test_fuzz.py, loaded by its CLI through ``SCHEMATHESIS_HOOKS``: beyond
``not_a_server_error``, no answer leaks a stack trace or a file path, every JSON body (and every event of a stream)
is strict JSON, and every ``PING_EVERY`` responses the server still answers ``/health`` and an ordinary request
within ``PING_TIMEOUT_S`` (a wedged server answers neither, or only ``/health``). The server's base URL comes in
``CONVEYOR_FUZZ_URL``."""

from __future__ import annotations

import json
import os

import httpx
import schemathesis

LEAKS = ("Traceback (most recent call last)", 'File "/', "site-packages", "<backtrace>", "panic")
PING_EVERY = 25
PING_TIMEOUT_S = 10.0


def _refuse_constant(constant: str):
    raise ValueError(f"{constant} is not JSON")


@schemathesis.check
def no_trace_or_path(ctx, response, case):
    """No stack trace, native backtrace or installation path in any answer."""
    text = response.content.decode("utf-8", "replace")
    found = [marker for marker in LEAKS if marker in text]
    if found:
        raise AssertionError(f"the answer leaks {found}: {text[:300]}")


@schemathesis.check
def strict_json(ctx, response, case):
    """A JSON answer, and each event of an SSE stream, parses as strict JSON (no NaN or Infinity)."""
    kind = (response.headers.get("content-type") or [""])[0]
    text = response.content.decode("utf-8", "replace")
    if kind.startswith("application/json"):
        json.loads(text, parse_constant=_refuse_constant)
    elif kind.startswith("text/event-stream") and not response.stream_cut_short:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            raise AssertionError(f"a stream that does not end with [DONE]: {text[-300:]}")
        for event in events[:-1]:
            json.loads(event, parse_constant=_refuse_constant)


@schemathesis.check
class still_answers:  # noqa: N801 - the check's name on the command line
    """Every PING_EVERY responses: /health 200 and an ordinary completion answered within PING_TIMEOUT_S."""

    def __init__(self) -> None:
        self.responses = 0
        self.pings = 0

    def after_response(self, ctx, response, case):
        self.responses += 1
        if self.responses % PING_EVERY == 0:
            ping()
            self.pings += 1

    def after_run(self, ctx):
        ping()


def ping() -> None:
    url = os.environ["CONVEYOR_FUZZ_URL"]
    try:
        health = httpx.get(url + "/health", timeout=PING_TIMEOUT_S).status_code
        ordinary = httpx.post(url + "/v1/completions", timeout=PING_TIMEOUT_S,
                              json={"prompt": "w5 w6", "max_tokens": 2}).status_code
    except httpx.HTTPError as exc:
        raise AssertionError(f"the server does not answer within {PING_TIMEOUT_S:.0f} s: {exc!r}") from None
    if (health, ordinary) != (200, 200):
        raise AssertionError(f"/health {health}, an ordinary completion {ordinary}")
