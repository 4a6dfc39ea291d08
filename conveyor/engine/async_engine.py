"""``AsyncEngine``: an ``LLMEngine`` stepping in a background thread, with one async output stream per request.

Why a thread: on CPU torch a step is blocking compute that releases the GIL inside kernels, so a dedicated
thread keeps the event loop (HTTP parsing, SSE writes) responsive while the model runs. ``LLMEngine`` is not
thread-safe, so the asyncio side never touches it: every call (add, abort, any function) goes through a
command queue that the engine thread drains between steps. Outputs travel back with one
``loop.call_soon_threadsafe`` per step, and the engine's numbers (running, waiting, KV usage, ...) as ``stats``,
an immutable ``SchedulerStats`` the engine thread replaces after every step and every command.
(Decoding token ids to text is read-only, so the server formats logprobs with the tokenizer on the loop.)

    asyncio thread                     engine thread
    add_request() --command-->  [drain commands] -> step() -> outputs
    stream.__anext__() <--call_soon_threadsafe-- ...

A stream read on the event loop while the engine thread goes on should ask for deltas
(``SamplingParams.output_kind`` DELTA, as the server does): each is a fresh object the engine thread never touches
again. A cumulative output is the engine's own state, which the next step extends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from conveyor.engine.engine_client import (  # noqa: F401 - the errors and streams are re-exported here
    EngineClient, EngineDeadError, EngineInfo, EngineShuttingDownError, RequestFailedError, RequestStream,
)
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.step_loop import STOP, StepLoop

if TYPE_CHECKING:  # annotations only: the API process of ``conveyor serve`` imports this module without torch
    from conveyor.engine.llm_engine import LLMEngine

logger = logging.getLogger("conveyor.engine")

T = TypeVar("T")

THREAD_JOIN_TIMEOUT_S = 30.0  # shutdown: how long to wait for the engine thread to finish its step and stop


class AsyncEngine(EngineClient):
    """Runs ``engine.step()`` in a background thread while work exists; ``add_request`` returns a stream.

    ``output_listeners`` and ``step_listeners`` (the engine's own list) are called on the engine thread and must
    not touch the engine.
    """

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine.scheduler.make_stats())  # stats: replaced whole by the engine thread
        self.engine = engine
        self.info: EngineInfo = engine.info
        self.step_listeners = engine.step_listeners
        self.output_listeners = engine.output_processor.listeners
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Guards "is the engine thread still taking commands?" against "put a command": once the thread stops,
        # no command may be queued that nobody would ever answer.
        self._closed_lock = threading.Lock()
        self._closed: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._step_loop = StepLoop(engine, self._commands, self._publish, self._set_stats)

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the streams."""
        self._start_loop_side()
        self.engine.structured.prepare()  # before requests arrive, so the first constrained one stalls nobody
        self._thread = threading.Thread(target=self._run, name="conveyor-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    async def shutdown(self) -> None:
        """Abort whatever is left and stop the engine thread."""
        self._abort_all()
        self._commands.put(STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, THREAD_JOIN_TIMEOUT_S)

    async def _add(self, request_id: str, prompt, params, arrival: float) -> None:
        # The prompt function runs on the engine thread just before the add, in the same command, so tokenizing
        # costs the event loop nothing and no extra wait for a step.
        added = self._submit(lambda e: e.add_request(request_id, prompt(self.info) if callable(prompt) else prompt,
                                                     params, arrival))
        if self.engine.step_cutter is not None:  # after the submit: a request the step already holds cannot cut it
            self.engine.step_cutter.offer(params.priority)
        await added

    async def add_prefill_request(self, request_id: str, prompt, params) -> RequestStream:
        """``add_request`` run only to the first token (``LLMEngine.add_prefill_request``): the stream's last
        output carries ``kv_handoff``, unless the request ended at its first token."""
        return await self._open_stream(request_id, None, lambda arrival: self.call(
            lambda e: e.add_prefill_request(request_id, prompt, params, arrival)))

    async def add_handoff(self, handoff) -> RequestStream:
        """Continue a request a prefill engine started (``LLMEngine.add_handoff``); its stream's outputs are
        cumulative from the first token."""
        return await self._open_stream(handoff.request_id, None, lambda arrival: self.call(
            lambda e: e.add_handoff(handoff, arrival)))

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when finished); its blocks are free before the next step runs."""
        if request_id in self._streams and self.is_running:
            self._commands.put(lambda e: self._step_loop.abort(e, request_id))

    async def tokenizer_call(self, fn: Callable[[EngineInfo], T]) -> T:
        """Run ``fn(info)`` on the engine thread between steps, where this layout prepares prompts too."""
        return await self.call(lambda _: fn(self.info))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result (or raise its error).
        The one safe way to read or change engine state from the event loop (``stats`` aside)."""
        return await self._submit(fn)

    def _submit(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Queue ``fn(engine)`` for the engine thread now; the future of its result (``call``)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._closed_lock:
            if self._closed is not None or not self.is_running:
                raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")
            self._commands.put((fn, future))
        return asyncio.wrap_future(future)

    # ---- engine thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._step_loop.run()
            self._close(EngineShuttingDownError("the engine has stopped"))
        except BaseException as exc:  # noqa: BLE001 - a crashed engine must fail every waiting client
            logger.exception("engine thread crashed")
            self.dead_error = exc
            self._close(EngineDeadError(f"the engine stopped: {exc!r}"))
            self._fail_all(exc)

    def _set_stats(self, stats) -> None:
        self.stats = stats

    def _close(self, error: BaseException) -> None:
        """Take no more commands; answer those still queued with ``error`` (nobody else ever would)."""
        with self._closed_lock:
            self._closed = error
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, tuple) and command[1].set_running_or_notify_cancel():
                command[1].set_exception(error)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _fail_all(self, exc: BaseException) -> None:
        error = EngineDeadError(f"the engine stopped: {exc!r}")
        try:
            self._loop.call_soon_threadsafe(self._deliver_error, error, exc)
        except RuntimeError:  # the event loop is already closed: nobody is left to tell
            pass


def serving_engine(engine: Any) -> Any:
    """``engine`` as a server drives it: an ``LLMEngine`` (stepped in this process) wrapped in an ``AsyncEngine``,
    any other engine (a ``ServedEngine``) as it is. An ``LLMEngine`` can exist only once its module is imported,
    so a process that never imported it (``conveyor serve``'s API process, its engine in a process of its own)
    never imports torch to ask."""
    llm_engine = sys.modules.get("conveyor.engine.llm_engine")
    if llm_engine is not None and isinstance(engine, llm_engine.LLMEngine):
        return AsyncEngine(engine)
    return engine
