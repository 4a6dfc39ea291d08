"""Every thread that serves requests in the default layout is killed in turn, in a real server: the API process's
sender thread, its watcher thread and its receiver task (``engine/core_client.py``), and the engine core process's
input thread and the thread that watches the API process (``engine/core_proc.py``). Each death must end the server
the way a dead engine does (issue 48, item 2): the request that needed the thread gets ``engine_dead`` instead of
hanging, the open stream ends with an in-band error and ``[DONE]``, ``/health`` stops saying 200, the engine
process is gone, the server stops with ``engine_died`` set (``conveyor serve`` then exits with status 1), and the
log says which thread died, on one ERROR line. Before, a dead sender thread left a server that answered ``/health``
with 200 and nothing else, and that SIGTERM could not stop.

The fault is an exception raised inside the thread (``tests/helpers/faults.py``), what a bug in its code would
raise. The server is uvicorn in a thread of this test, in front of an ``EngineCoreClient`` (the engine core in its
own process, as ``conveyor serve`` runs it), on uvloop and on asyncio's loop by turns.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest

from conveyor.engine.args import EngineArgs
from conveyor.engine.core_client import EngineCoreClient
from conveyor.server.app import build_app
from conveyor.server.launcher import make_server
from tests.helpers.faults import engine_core_with_faults, raise_in_engine_thread, raise_in_thread
from tests.helpers.server import TEST_DTYPE

pytestmark = pytest.mark.slow  # an engine process per case: run by CI, skipped by -m "not slow"

STREAM = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 400, "ignore_eos": True, "stream": True}
ORDINARY = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2}
ENDS_WITHIN_S = 15.0  # a bound against hangs: the death is handled at once, the server then stops in seconds


class Harness:
    """uvicorn (``GracefulServer``, as ``conveyor serve`` makes it) in a thread, serving an engine process."""

    def __init__(self, model_dir, loop: str) -> None:
        args = EngineArgs(model=str(model_dir), dtype=TEST_DTYPE, num_kv_blocks=256, block_size=16)
        self.core = EngineCoreClient(args, entry=engine_core_with_faults)
        app = build_app(self.core, "tiny", log_stats_interval_s=0.0, shutdown_timeout_s=2.0)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = make_server(app, "127.0.0.1", sock.getsockname()[1], log_level="warning", loop=loop)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self._sock = sock

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self._sock.close()
        if self.core._proc.is_alive():
            self.core._proc.kill()


def _kill_sender(h: Harness) -> None:
    raise_in_thread("conveyor-client-sender")  # it raises when the next frame wakes it: the trigger's


def _kill_watcher(h: Harness) -> None:
    raise_in_thread("conveyor-client-watcher")


def _kill_receiver(h: Harness) -> None:
    h.core._loop.call_soon_threadsafe(h.core._receiver.cancel)


def _kill_engine_input(h: Harness) -> None:
    raise_in_engine_thread(h.core._proc.pid, "conveyor-engine-input")


def _kill_engine_parent_watcher(h: Harness) -> None:
    raise_in_engine_thread(h.core._proc.pid, "conveyor-engine-parent")


# (name, kill, loop, what the ERROR line says, whether the thread dies only when the next request wakes it: a
# thread blocked in a read runs no Python until something arrives)
KILLS = [
    ("api-sender", _kill_sender, "uvloop", "sender thread died", True),
    ("api-watcher", _kill_watcher, "asyncio", "watcher thread died", False),
    ("api-receiver", _kill_receiver, "uvloop", "receiver task stopped", False),
    ("engine-input", _kill_engine_input, "asyncio", "input thread died", True),
    ("engine-parent-watcher", _kill_engine_parent_watcher, "uvloop", "parent thread died", False),
]


@pytest.mark.parametrize("name,kill,loop,said,woken", KILLS, ids=[k[0] for k in KILLS])
def test_a_dead_serving_thread_ends_the_server_and_tells_every_request(tiny_chat_dir, caplog, name, kill, loop,
                                                                       said, woken):
    caplog.set_level(logging.ERROR)
    h = Harness(tiny_chat_dir, loop)
    try:
        lines: list[str] = []
        with httpx.stream("POST", h.url + "/v1/completions", json=STREAM, timeout=60) as resp:
            assert resp.status_code == 200
            events = resp.iter_lines()
            while not lines:  # an in-flight request, past its first chunk
                line = next(events)
                if line.startswith("data: "):
                    lines.append(line[6:])
            assert httpx.get(h.url + "/health").status_code == 200
            kill(h)
            if not woken:  # it dies on its own, within its poll period: let it, then see that nothing hangs
                deadline = time.monotonic() + ENDS_WITHIN_S
                while h.core.dead_error is None and time.monotonic() < deadline:
                    time.sleep(0.05)
            # The next request needs the dead thread (or finds the engine dead): it must be answered, not hang.
            try:
                trigger = httpx.post(h.url + "/v1/completions", json=ORDINARY, timeout=ENDS_WITHIN_S)
                trigger_said = (trigger.status_code, trigger.json()["error"]["code"])
            except httpx.TimeoutException:
                raise  # a hang: the failure this test exists for
            except httpx.TransportError:  # the server is closing after the death: refused, or closed unanswered
                trigger_said = (None, "closed")
            for line in events:
                if line.startswith("data: "):
                    lines.append(line[6:])
        assert trigger_said in {(503, "engine_dead"), (None, "closed")}, trigger_said
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "engine_dead", lines[-3:]
        try:  # the truth, as long as it still answers
            assert httpx.get(h.url + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass
        h.thread.join(ENDS_WITHIN_S)
        assert not h.thread.is_alive() and h.server.engine_died, "the server did not stop after the death"
        h.core._proc.join(ENDS_WITHIN_S)
        assert not h.core._proc.is_alive(), "the engine process outlived the server"
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and said in r.getMessage()]
        assert len(errors) == 1, [r.getMessage()[:200] for r in caplog.records]
    finally:
        h.close()
