"""``EngineCoreClient``: the API process's end of an engine core running in its own process (``engine.core_proc``).

It starts the process (spawn: a fresh interpreter, so no torch thread pool is inherited half-initialised), waits
for it to be ready, and then serves the event loop with three threads of its own, so that the loop never touches
a socket or waits on one:

    event loop:      the loop's requests (add, finish, stop) -> encode -> queue
    sender thread:   queue -> PUSH socket
    receiver task:   PULL socket (zmq.asyncio, on the loop) -> decode -> output processing, one message at a time
    watcher thread:  waits for the engine process to exit -> the loop declares the engine dead

A request is encoded on the loop, in its caller's context, as vLLM's ``AsyncLLM`` does: one that cannot be encoded
(a number msgpack cannot carry) fails alone, with an error its caller gets, and never reaches the sender thread.
Each thread and the receiver task is supervised: if one ends while the client is not closing, whatever the
reason, the engine is declared dead (one ERROR line, every in-flight request told, the server exits with status 1)
and the engine process is killed, instead of a server that answers ``/health`` but nothing else.

The receiver is a task, not a thread: handing each message from a thread to the loop cost a GIL hand-off and a
wake-up per engine step (0.7 ms a step at batch 1). Reading a ZeroMQ socket from the loop is safe where reading
the multiprocessing pipe was not: the loop watches only ZeroMQ's notification fd, and a message is read whole or
not at all. While the loop is busy the task reads nothing, so the engine's output queue fills and its step loop
waits (back-pressure).

Output processing happens here, on the loop, as in vLLM v1's ``AsyncLLM``: the engine core sends each step's
sampled tokens (``CoreStepOutput``), and this process's ``OutputProcessor`` detokenizes them, checks stop strings
(a hit sends ``FinishRequests`` to the core) and delivers every stream's output of the step in one go.
Prompts are prepared (tokenized, chat-rendered, length-checked) here too, off the loop, with a copy of the
engine's tokenizer that came with its "ready" message (so this process need not import torch to load one).

The engine is dead when its process has exited, and only then (or when it said so in its last message): every
in-flight stream and pending add gets ``EngineDeadError`` and the ``on_dead`` callbacks run (the server then
exits with status 1, as with a crashed engine thread).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import queue
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from conveyor.core.outputs import SchedulerStats
from conveyor.core.request import RequestStatus
from conveyor.engine import ipc
from conveyor.engine.args import EngineArgs
from conveyor.engine.core_proc import run_engine_core
from conveyor.engine.core_step import CoreStepOutput, child_requests
from conveyor.engine.engine_client import EngineClient, EngineDeadError, EngineInfo
from conveyor.engine.output_processor import OutputProcessor

logger = logging.getLogger("conveyor.engine")

STARTUP_TIMEOUT_S = 600.0  # a big checkpoint on a slow disk; a failure is reported as soon as it happens
# Shutdown: how long the process may take to finish its step and exit before it is killed. The drain has ended
# every request by then, so a kill loses nothing; the bound keeps SIGTERM's exit within the drain's deadline.
STOP_TIMEOUT_S = 5.0
DEAD_STOP_S = 1.0  # the same for a process declared dead while it still runs (it cannot be told to stop)
POLL_MS = 100  # how often the sender thread looks up from its socket to see whether it should stop
WATCH_POLL_S = 0.5  # how often the watcher looks up from its wait to see whether it should stop
# The engine process has exited: how long its last message (why it died) may take to be handled first.
EXIT_GRACE_S = 0.5


class EngineCoreClient(EngineClient):
    """Starts the engine core process for ``args``; ``wait_ready()`` blocks until it has loaded the model (and
    raises if it could not), so the caller can import and build the server meanwhile.

    ``output_listeners`` and ``step_listeners`` are called on the event loop. ``info`` waits for the process to
    be ready (``wait_ready``).
    """

    def __init__(self, args: EngineArgs, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 entry: Callable = run_engine_core) -> None:
        """``entry``: the engine process's entry point, ``run_engine_core`` or (tests) a picklable wrapper of it."""
        self._endpoints = ipc.Endpoints.fresh()
        self._zmq = zmq.Context()
        # Bound before the process starts, so its connects find them; each then belongs to one thread.
        self._input = ipc.make_socket(self._zmq, zmq.PUSH, self._endpoints.input, bind=True)
        self._output = ipc.make_socket(self._zmq, zmq.PULL, self._endpoints.output, bind=True, hwm=ipc.OUTPUT_HWM)
        self._receiver: asyncio.Task | None = None
        self._output_async: zmq.asyncio.Socket | None = None  # the output socket as the receiver task reads it
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._proc = context.Process(target=entry, args=(args, child_conn, self._endpoints),
                                     name="conveyor-engine-core", daemon=True)
        self._proc.start()
        child_conn.close()
        self._args, self._startup_timeout_s, self._started = args, startup_timeout_s, time.monotonic()
        super().__init__(SchedulerStats())  # the engine's own stats arrive with "ready"
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # encoded frames (None: stop)
        self._encoder = msgspec.msgpack.Encoder()  # the event loop's
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._stopping = False
        self._info: EngineInfo | None = None
        self.output_processor: OutputProcessor | None = None

    def wait_ready(self) -> EngineCoreClient:
        """Block until the engine process is ready; raise what building the engine raised there (or
        RuntimeError when the process died or timed out), and reap the process, if it cannot start."""
        if self._info is None:
            try:
                info, self.stats = self._wait_ready(self._startup_timeout_s - (time.monotonic() - self._started))
            except BaseException:
                self._proc.kill()
                self._proc.join(STOP_TIMEOUT_S)  # reaped: no zombie in a server that outlives this engine
                self._close_sockets()
                raise
            self._info = info.loaded()  # a tokenizer that could not travel is loaded here
            self.output_processor = OutputProcessor(self._info.tokenizer, detokenize=self._args.detokenize,
                                                    listeners=self.output_listeners)
        return self

    @property
    def info(self) -> EngineInfo:
        """The engine's facts (from its "ready" message); blocks until the process is ready."""
        return self.wait_ready()._info

    def _wait_ready(self, timeout_s: float) -> tuple[EngineInfo, SchedulerStats]:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.1):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine core process exited with code {self._proc.exitcode} before it "
                                   "was ready (see its log above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core process was not ready after {timeout_s:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise RuntimeError("the engine core process exited before it was ready (see its log above)") from None
        if kind != "ready":  # "failed": the very error building the engine raised (a bad model: ValueError, ...)
            raise payload
        return payload

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the sender, receiver and watcher threads for the running event loop."""
        self.wait_ready()
        self._start_loop_side()
        self._output_async = zmq.asyncio.Socket.from_socket(self._output)
        self._receiver = asyncio.ensure_future(self._receive_forever(self._output_async))
        self._receiver.add_done_callback(self._on_receiver_end)
        for body, name in ((self._send_forever, "sender"), (self._watch_process, "watcher")):
            thread = threading.Thread(target=self._supervised, args=(name, body), name=f"conveyor-client-{name}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    @property
    def is_running(self) -> bool:
        """The engine process runs and every part of this client that talks to it does (``/health``)."""
        return (self.dead_error is None and not self._stopping and self._proc.is_alive()
                and all(t.is_alive() for t in self._threads)
                and (self._receiver is None or not self._receiver.done()))

    async def shutdown(self) -> None:
        """Abort whatever is left, tell the process to stop, and wait for it (kill it after STOP_TIMEOUT_S, or at
        once when it was declared dead while still running)."""
        self._abort_all()
        wait = DEAD_STOP_S
        if self.dead_error is None and not self._stopping:
            self._stopping = True
            self._send(ipc.Shutdown())
            wait = STOP_TIMEOUT_S
        await asyncio.to_thread(self._proc.join, wait)
        if self._proc.is_alive():
            logger.warning("the engine core process did not stop within %.0f s: killing it", wait)
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 5.0)
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
            # Closed through its asyncio side, which takes its fd off the event loop: closed underneath, the fd
            # stays registered, and the next engine's socket that gets the same fd number is never read (one
            # API process starting engines one after another: models on demand).
            self._output_async.close(linger=0)
        await asyncio.to_thread(self._close_sockets)

    def _close_sockets(self) -> None:
        """Stop the threads (each closes its own socket), then the context; remove the socket files."""
        self._closing.set()
        self._outbox.put(None)
        for thread in self._threads:
            if thread.name != "conveyor-client-watcher":
                thread.join(ipc.LINGER_S + 1.0)
        if not self._threads:  # never started: the input socket is still this thread's
            self._input.close(linger=0)
        self._output.close(linger=0)  # the receiver task has ended
        self._zmq.term()
        self._endpoints.remove()
        self._conn.close()

    # ---- requests ---------------------------------------------------------------------------------------
    async def _add(self, request_id: str, prompt, params, arrival: float) -> None:
        if callable(prompt):  # tokenizing a long prompt takes a while: never on the event loop
            prompt = await asyncio.to_thread(prompt, self._info)
        text, token_ids = self._info.tokenize_prompt(prompt)
        processor = self.output_processor
        if request_id in processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        processor.add(request_id, text, token_ids, child_requests(request_id, params), arrival)
        try:
            await self._request(lambda call_id: ipc.AddRequest(call_id, request_id, token_ids, params, arrival))
        except asyncio.CancelledError:
            raise  # add_request aborts it: it may have been admitted
        except BaseException:
            processor.forget(request_id)  # refused
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when finished): its stream ends now with finish_reason "abort", and its blocks
        are free before the engine's next step."""
        if request_id not in self._streams or not self.is_running:
            return
        processor = self.output_processor
        children = processor.unfinished_child_ids(request_id)
        state = processor.abort(request_id, time.monotonic())
        if children:
            self._finish(children, RequestStatus.FINISHED_ABORTED)
        if state is not None:
            self._deliver(processor.emit([state]))

    def _finish(self, child_ids: list[str], status: RequestStatus) -> None:
        """End (child) requests in the engine core's scheduler (before its next step)."""
        self._send(ipc.FinishRequests(child_ids, status))

    async def _request(self, make: Callable[[int], ipc.AddRequest]) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")
        call_id = next(self._call_ids)
        try:
            frame = self._encoder.encode(make(call_id))
        except (OverflowError, TypeError, ValueError) as exc:  # e.g. an int past 64 bits: this request alone fails
            raise ValueError(f"the request holds a value the engine cannot be sent ({exc})") from None
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._outbox.put(frame)
        try:
            ipc.raise_error(await future)
        finally:
            self._calls.pop(call_id, None)

    def _send(self, message: ipc.FinishRequests | ipc.Shutdown) -> None:
        """Queue a message that answers nobody (ids and names only: it always encodes). On the event loop."""
        self._outbox.put(self._encoder.encode(message))

    # ---- threads ----------------------------------------------------------------------------------------
    def _supervised(self, name: str, body: Callable[[], None]) -> None:
        """Run a thread's ``body``; if it raises while this client is not closing, the engine is out of reach:
        declare it dead (the server then exits with status 1) rather than leave a server that wedges."""
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - whatever ended the thread, the loop must hear of it
            if not (self._closing.is_set() or self._stopping):
                self._from_thread(self._died, f"the API process's {name} thread died: {exc!r}; the engine core "
                                  "process cannot be reached")

    def _from_thread(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    def _send_forever(self) -> None:
        try:
            while (frame := self._outbox.get()) is not None:
                while not self._input.poll(POLL_MS, zmq.POLLOUT):  # no engine connected (it is gone)
                    if self._closing.is_set():
                        return
                self._input.send(frame, zmq.NOBLOCK)
        finally:
            self._input.close(linger=0)

    async def _receive_forever(self, sock: zmq.asyncio.Socket) -> None:
        decoder = ipc.message_decoder()
        while True:
            try:
                frame = await sock.recv()
            except zmq.ZMQError:
                return  # closing; otherwise _on_receiver_end declares the engine dead
            try:
                self._handle(decoder.decode(frame))
            except Exception as exc:  # noqa: BLE001 - a receiver that stopped would hang every stream for good
                logger.exception("could not handle a message of the engine core process")
                self._died(f"the API process could not handle the engine's message: {exc!r}")
                return
            # A message already queued comes back from recv() as a finished future, and awaiting one does not
            # yield: while the engine keeps ahead of this loop, nothing else (HTTP, /metrics) would ever run.
            await asyncio.sleep(0)

    def _watch_process(self) -> None:
        # A wait with a timeout: a thread blocked in select() for good could neither stop nor fail visibly.
        while not multiprocessing.connection.wait([self._proc.sentinel], WATCH_POLL_S):
            if self._closing.is_set():
                return
        self._from_thread(self._on_process_exit)

    # ---- event loop side --------------------------------------------------------------------------------
    def _on_receiver_end(self, task: asyncio.Task) -> None:
        if self._closing.is_set() or self._stopping:
            return
        why = "it was cancelled" if task.cancelled() else f"{task.exception()!r}" if task.exception() else "it ended"
        self._died(f"the API process's receiver task stopped ({why}); the engine core process cannot be heard")

    def _on_process_exit(self) -> None:
        if not self._stopping:  # let a last message saying why be handled first
            self._loop.call_later(EXIT_GRACE_S, self._died, None)

    def _handle(self, message: ipc.EngineMessage) -> None:
        if message.stats is not None:
            self.stats = message.stats
        for record in message.records:
            for listener in self.step_listeners:
                listener(record)
        for reply in message.replies:
            future = self._calls.get(reply.call_id)
            if future is not None and not future.done():
                future.set_result(reply)
        if message.step is not None:
            self._process(message.step)
        if message.dead is not None:
            self._died(f"the engine core raised: {message.dead}")

    def _process(self, step: CoreStepOutput) -> None:
        """One step's tokens through the output processor; what it decided goes back to the core."""
        processor = self.output_processor
        self._deliver(processor.emit(processor.settle(processor.process(step), self._finish, step.time)))

    def _died(self, why: str | None) -> None:
        if self.dead_error is not None or self._stopping:
            return
        if why is None:  # the process has exited: its exit code says how
            self._proc.join(1.0)
            why = f"the engine core process (pid {self._proc.pid}) exited with code {self._proc.exitcode}"
        logger.error("%s", why)
        cause = EngineDeadError(why.splitlines()[0])
        self.dead_error = cause
        error = EngineDeadError(f"the engine stopped: {cause!r}")
        calls, self._calls = self._calls, {}  # pending adds
        for future in calls.values():
            if not future.done():
                future.set_exception(error)
        self._deliver_error(error, cause)
