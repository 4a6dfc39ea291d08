"""A real uvicorn server on 127.0.0.1 in a background thread, for the server tests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine
from conveyor.models.build import DTYPES
from conveyor.server.app import build_app
from conveyor.server.launcher import make_server

# float64 where the loader offers it: random tiny weights have near-ties that float32 batching noise can flip.
TEST_DTYPE = "float64" if "float64" in DTYPES else "float32"

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w5{% endif %}")


def make_engine(model_dir, **overrides) -> LLMEngine:
    args = dict(model=str(model_dir), dtype=TEST_DTYPE, num_kv_blocks=256, block_size=16, debug_invariants=True)
    args.update(overrides)
    return LLMEngine(EngineArgs(**args))


def run_to_completion(engine: LLMEngine) -> dict:
    """Step ``engine`` until nothing is left; returns every request's final output by id."""
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def wait_for(predicate, timeout: float = 5.0) -> bool:
    """Whether ``predicate()`` turned true within ``timeout`` seconds (polled): for what a server publishes
    after it answered (metrics, gauges), which a test must not expect at the same instant."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@contextmanager
def running_server(app, **server_kwargs):
    """Serve ``app`` on a free port; yields the base URL (``http://127.0.0.1:PORT``). ``server_kwargs`` go to
    ``make_server`` (timeouts, ``exit_on_engine_death``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(app, "127.0.0.1", port, log_level="warning", **server_kwargs)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextmanager
def serve_model(model_dir, served_model_name: str = "tiny", api_key: str | None = None, server_kwargs=None,
                **engine_overrides):
    """Build an engine for ``model_dir`` and serve it; yields (base URL, app)."""
    engine = make_engine(model_dir, **engine_overrides)
    app = build_app(engine, served_model_name, api_key, log_stats_interval_s=0.0, shutdown_timeout_s=2.0)
    with running_server(app, **(server_kwargs or {})) as url:
        yield url, app
