"""The event-loop side of an engine that runs elsewhere (a thread: ``AsyncEngine``; a process:
``EngineCoreClient``): one async output stream per request, admission, graceful drain, and failing every stream
when the engine dies. Subclasses provide the transport: ``start``, ``is_running``, ``call``, ``abort``,
``shutdown`` and ``_add``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from conveyor.core.outputs import SchedulerStats
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.outputs import RequestOutput

logger = logging.getLogger("conveyor.engine")

DRAIN_ABORT_GRACE_S = 10.0  # after the drain deadline aborts what is left: how long the aborts may take


class EngineDeadError(RuntimeError):
    """The engine crashed; no request can be served any more."""


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


class EngineClient:
    """Streams, admission and drain; the transport to the engine is the subclass's.

    ``output_listeners`` are called with every ``RequestOutput`` (metrics use this; the subclass says on which
    thread); they must be quick. Callbacks in ``on_dead`` are called on the event loop, once, with the exception
    that killed the engine, after every in-flight stream got its error (the server exits then, so that a
    supervisor restarts it). ``stats`` is the engine's latest immutable ``SchedulerStats``.
    """

    engine: Any  # the engine, or a view of it with the tokenizer, model_info, args and max_model_len

    def __init__(self, stats: SchedulerStats) -> None:
        self.output_listeners: list[Callable[[RequestOutput], None]] = []
        self.on_dead: list[Callable[[BaseException], None]] = []
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = True
        self.dead_error: BaseException | None = None
        self._idle = asyncio.Event()
        self.stats = stats

    # ---- transport (the subclass's) ---------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when finished); its blocks are free before the next step runs."""
        raise NotImplementedError

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` where the engine runs, between steps, and return its result (or raise its error)."""
        raise NotImplementedError

    async def shutdown(self) -> None:
        """Abort whatever is left and stop the engine."""
        raise NotImplementedError

    async def tokenizer_call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` where tokenizing is cheapest for the event loop; ``fn`` may use only the engine's
        tokenizer, ``encode``, ``model_info`` and ``max_model_len`` (``/tokenize``, ``/detokenize``)."""
        return await self.call(fn)

    async def _add(self, request_id: str, prompt, params: SamplingParams, arrival: float) -> None:
        raise NotImplementedError

    def _start_loop_side(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- lifecycle --------------------------------------------------------------------------------------
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

    # ---- requests ---------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """Queue a request; return its stream. Raises what ``LLMEngine.add_request`` raises (ValueError,
        QueueFullError), or EngineShuttingDownError / EngineDeadError.

        ``prompt`` may be a function ``engine -> prompt`` (tokenizing, chat templates, length checks), which the
        subclass runs where it is cheapest, before the add.
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
            await self._add(request_id, prompt, params, arrival)
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left while the add was queued: it may have been admitted
            self._forget(request_id)
            raise
        except BaseException:
            self._forget(request_id)
            raise
        return stream

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
