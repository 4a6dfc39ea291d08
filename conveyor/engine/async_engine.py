"""``AsyncEngine``: an ``LLMEngine`` stepping in a background thread, with one async output stream per request.

Why a thread: on CPU torch a step is blocking compute that releases the GIL inside kernels, so a dedicated
thread keeps the event loop (HTTP parsing, SSE writes) responsive while the model runs. ``LLMEngine`` is not
thread-safe, so the asyncio side never touches it: every call (add, abort, any function) goes through a
command queue that the engine thread drains between steps. Outputs travel back with one
``loop.call_soon_threadsafe`` per step, and the engine's numbers (running, waiting, KV usage, ...) as ``stats``,
an immutable ``SchedulerStats`` the engine thread replaces after every step and every command.
(Decoding token ids to text is read-only, so the server formats logprobs with the tokenizer on the loop.)

    asyncio thread                     engine thread
    add_request() --command-->  [drain commands] -> step() -> snapshot outputs
    stream.__anext__() <--call_soon_threadsafe-- ...
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from conveyor.core.outputs import SchedulerStats
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm_engine import LLMEngine, PromptType
from conveyor.engine.outputs import RequestOutput

logger = logging.getLogger("conveyor.engine")

# While requests wait but none can start (a dynamic batch still forming until max_wait_ms), the engine thread
# waits this long for commands before it tries to schedule again, instead of spinning.
IDLE_POLL_S = 0.002
DRAIN_ABORT_GRACE_S = 10.0  # after the drain deadline aborts what is left: how long the aborts may take
THREAD_JOIN_TIMEOUT_S = 30.0  # shutdown: how long to wait for the engine thread to finish its step and stop


class EngineDeadError(RuntimeError):
    """The engine thread crashed; no request can be served any more."""


class EngineShuttingDownError(RuntimeError):
    """The engine is shutting down and admits no new requests."""


class RequestFailedError(RuntimeError):
    """The engine could not process this one request (it survived; see ``RequestOutput.error``)."""


class RequestStream:
    """The outputs of one request, as the engine produces them. Outputs are cumulative (whole text so far), so
    a slow reader may skip intermediate ones: it always gets the latest, and always the final one."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty() and not isinstance(item, BaseException):
            item = self._queue.get_nowait()  # coalesce: the newest cumulative output subsumes older ones
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


def _snapshot(out: RequestOutput) -> RequestOutput:
    """Copy the lists the engine thread keeps appending to, so the asyncio side reads a consistent state."""
    outputs = [
        replace(c, token_ids=list(c.token_ids), token_times=list(c.token_times),
                logprobs=None if c.logprobs is None else list(c.logprobs))
        for c in out.outputs
    ]
    return replace(out, outputs=outputs, metrics=replace(out.metrics))


_STOP = object()


class AsyncEngine:
    """Runs ``engine.step()`` in a background thread while work exists; ``add_request`` returns a stream.

    Listeners in ``output_listeners`` are called on the engine thread with every ``RequestOutput`` (metrics use
    this); they must be quick and must not touch the engine. Callbacks in ``on_dead`` are called on the event
    loop, once, with the exception that killed the engine thread, after every in-flight stream got its error
    (the server exits then, so that a supervisor restarts it).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.output_listeners: list[Callable[[RequestOutput], None]] = []
        self.on_dead: list[Callable[[BaseException], None]] = []
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Guards "is the engine thread still taking commands?" against "put a command": once the thread stops,
        # no command may be queued that nobody would ever answer.
        self._closed_lock = threading.Lock()
        self._closed: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = True
        self.dead_error: BaseException | None = None
        self._idle = asyncio.Event()
        self.stats: SchedulerStats = engine.scheduler.make_stats()  # replaced whole by the engine thread

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="conveyor-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def stop_admissions(self) -> None:
        """New requests are refused with ``EngineShuttingDownError`` from now on."""
        self._accepting = False

    async def drain(self, timeout_s: float) -> None:
        """Graceful shutdown: refuse new requests, let in-flight ones finish for up to ``timeout_s``, then abort
        the rest (their streams end with finish_reason "abort")."""
        self.stop_admissions()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            left = list(self._streams)
            logger.warning("shutdown: aborting %d unfinished request(s) after %.0f s", len(left), timeout_s)
            for request_id in left:
                self.abort(request_id)
            try:
                await asyncio.wait_for(self._idle.wait(), DRAIN_ABORT_GRACE_S)
            except asyncio.TimeoutError:
                pass

    async def shutdown(self) -> None:
        """Abort whatever is left and stop the engine thread."""
        self.stop_admissions()
        for request_id in list(self._streams):
            self.abort(request_id)
        self._commands.put(_STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, THREAD_JOIN_TIMEOUT_S)

    # ---- requests ---------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType | Callable[[LLMEngine], PromptType],
                          params: SamplingParams, arrival_time: float | None = None) -> RequestStream:
        """Queue a request; return its stream. Raises what ``LLMEngine.add_request`` raises (ValueError,
        QueueFullError), or EngineShuttingDownError / EngineDeadError.

        ``prompt`` may be a function ``engine -> prompt``: it runs on the engine thread just before the add, in
        the same command, so tokenizing, chat templates and length checks cost no extra wait for a step.
        """
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error!r}")
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down and accepts no new requests")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream  # before the command: the first output may come right after it
        self._idle.clear()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        try:
            await self.call(lambda e: e.add_request(
                request_id, prompt(e) if callable(prompt) else prompt, params, arrival))
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left while the add was queued: it may have been admitted
            self._forget(request_id)
            raise
        except BaseException:
            self._forget(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when finished); its blocks are free before the next step runs."""
        if request_id in self._streams and self.is_running:
            self._commands.put(lambda e: self._abort_on_engine(e, request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result (or raise its error).
        The one safe way to read or change engine state from the event loop (``stats`` aside)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._closed_lock:
            if self._closed is not None or not self.is_running:
                raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")
            self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    # ---- engine thread ----------------------------------------------------------------------------------
    def _abort_on_engine(self, engine: LLMEngine, request_id: str) -> None:
        out = engine.abort_request(request_id)
        if out is not None:
            self._publish([out])

    def _run(self) -> None:
        engine = self.engine
        idle_wait = 0.0
        try:
            while True:
                # Block while idle; while requests run, just take what has arrived since the last step.
                timeout = idle_wait if engine.has_unfinished_requests() else None
                if not self._run_commands(timeout):
                    self._close(EngineShuttingDownError("the engine has stopped"))
                    return
                idle_wait = 0.0
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    if outputs:
                        self._publish(outputs)
                    elif not engine.scheduler.num_running:
                        idle_wait = IDLE_POLL_S  # only time or a new command can start a waiting request
                    self.stats = engine.scheduler.make_stats()
        except BaseException as exc:  # noqa: BLE001 - a crashed engine must fail every waiting client
            logger.exception("engine thread crashed")
            self.dead_error = exc
            self._close(EngineDeadError(f"the engine stopped: {exc!r}"))
            self._fail_all(exc)

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

    def _run_commands(self, timeout: float | None) -> bool:
        """Run queued commands, waiting up to ``timeout`` s for the first (None: forever). False: stop."""
        try:
            command = self._commands.get(timeout=timeout) if timeout != 0.0 else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            if isinstance(command, tuple):
                fn, future = command
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except Exception as exc:  # noqa: BLE001 - delivered to the awaiting caller
                        future.set_exception(exc)
            else:
                command(self.engine)
            self.stats = self.engine.scheduler.make_stats()  # a command may have added, aborted, ...
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            for listener in self.output_listeners:
                listener(out)
        batch = [_snapshot(out) for out in outputs]
        self._loop.call_soon_threadsafe(self._deliver, batch)

    def _fail_all(self, exc: BaseException) -> None:
        error = EngineDeadError(f"the engine stopped: {exc!r}")
        try:
            self._loop.call_soon_threadsafe(self._deliver_error, error, exc)
        except RuntimeError:  # the event loop is already closed: nobody is left to tell
            pass

    # ---- event loop side --------------------------------------------------------------------------------
    def _deliver(self, batch: list[RequestOutput]) -> None:
        for out in batch:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out if out.error is None else RequestFailedError(out.error))
                if out.finished:
                    self._forget(out.request_id)

    def _deliver_error(self, error: BaseException, cause: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.put(error)
            self._forget(request_id)
        for callback in self.on_dead:
            callback(cause)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()
