"""The engine core in a process of its own (what ``conveyor serve`` runs), as vLLM v1 runs its ``EngineCoreProc``.

Why a process: in one process the step loop and the event loop (HTTP, JSON, SSE) take turns on one GIL, and every
torch op of a step gives the GIL up and must win it back; a busy event loop then stretches the step. Here the
engine owns its interpreter, runs only the core of each step (schedule, execute, update: ``core_step``) and sends
the sampled tokens; the API process detokenizes, checks stop strings and streams (``core_client``). The two talk
over ``engine.ipc``'s sockets; requests are read by a thread of their own, so the API process's sends never wait
for a step:

    input thread:  PULL socket -> decode -> command queue
    main thread:   StepLoop: [commands] -> core_step() -> one EngineMessage per round -> encode -> PUSH socket

The output socket holds at most ``ipc.OUTPUT_HWM`` messages: an API process that falls behind makes the step loop
wait instead of letting a queue grow without bound. The process ignores SIGINT and SIGTERM (the server drains, then
sends ``Shutdown``); it exits when told, when the API process is gone (the start-up pipe closes), or, after a last
message saying why, when the engine raises. Its other threads are supervised: a message the input thread cannot
decode is answered with an error when it names a call, and dropped otherwise; if the input thread or the thread
watching the API process dies, the step loop raises on its next round, so the process exits the same way (never a
process whose engine no longer hears its requests).
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

import msgspec
import zmq

from conveyor.core.outputs import SchedulerStats
from conveyor.engine import ipc
from conveyor.engine.args import EngineArgs
from conveyor.engine.core_step import CoreStepOutput
from conveyor.engine.engine_client import picklable
from conveyor.engine.step_loop import STOP, StepLoop
from conveyor.engine.step_record import StepRecord

if TYPE_CHECKING:  # imported where the engine is built: the API process imports this module and must not load torch
    from conveyor.engine.llm_engine import LLMEngine

logger = logging.getLogger("conveyor.engine")

DEAD_FLUSH_S = 5.0  # a crashing engine: how long its last message may wait for room
POLL_MS = 100  # how often a wait on the output path looks up to see whether the API process is gone
PARENT_POLL_S = 0.5  # how often the parent watcher looks up from its pipe (a thread blocked for good cannot fail)


class _Reply:
    """The future-like end of an add: its verdict goes into the message being filled when the add runs."""

    def __init__(self, core: "EngineCore", call_id: int) -> None:
        self.core, self.call_id = core, call_id

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def set_result(self, value) -> None:
        self.core.message.replies.append(ipc.Reply(self.call_id))

    def set_exception(self, exc: BaseException) -> None:
        self.core.message.replies.append(ipc.error_reply(self.call_id, exc))


def _add(request: ipc.AddRequest, engine: LLMEngine) -> None:
    engine.add_core_request(request.request_id, request.prompt_token_ids, request.params, request.arrival)


def _finish(request: ipc.FinishRequests, engine: LLMEngine) -> None:
    engine.finish_requests(child_ids=request.request_ids, status=request.status)


class EngineCore:
    """Runs the ``StepLoop`` on requests from the input socket and sends one ``EngineMessage`` per round."""

    def __init__(self, engine: LLMEngine, endpoints: ipc.Endpoints, context: zmq.Context) -> None:
        self.engine = engine
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.message = ipc.EngineMessage()
        self._last_stats: SchedulerStats | None = None
        self.parent_gone = threading.Event()  # then nobody reads: nothing may wait for the output path
        self._input = ipc.make_socket(context, zmq.PULL, endpoints.input, bind=False)
        self._output = ipc.make_socket(context, zmq.PUSH, endpoints.output, bind=False, hwm=ipc.OUTPUT_HWM)
        self._encoder = msgspec.msgpack.Encoder()
        engine.step_listeners.append(self._on_step)
        self.loop = StepLoop(engine, self.commands, self._publish, self._on_stats, self._flush, step=engine.core_step)

    def run(self) -> None:
        """Serve until ``Shutdown`` (or the API process is gone); raises what kills the engine, after sending
        the reason."""
        start_supervised(self, "input", self._read)
        try:
            self.loop.run()
            self._flush()
            if self.engine.step_cutter is not None:
                counts = self.engine.step_cutter.counts
                logger.info("steps cut short for arrivals that outranked them: %d of %d cuttable (%d in the native "
                            "stack), %d scheduled tokens and %.2f s of work dropped; not cuttable: %s", counts.cut,
                            counts.armed, counts.cut_native, counts.cut_tokens, counts.cut_seconds, counts.not_cut)
        except BaseException as exc:
            self.message.dead = f"{exc!r}\n{traceback.format_exc()}"
            self._flush(timeout=DEAD_FLUSH_S)
            raise
        finally:
            # What the socket still holds leaves before the context's term() returns (linger), unless nobody
            # would read it.
            self._output.close(linger=0 if self.parent_gone.is_set() else None)

    def _read(self) -> None:
        """Input socket -> command queue, so the API process's sends never wait for a step to end."""
        decoder = ipc.request_decoder()
        cutter = self.engine.step_cutter  # a step of only lower priorities stops for an arrival outranking it
        while True:
            try:
                frame = self._input.recv()
            except zmq.ZMQError:  # the context is closing (ETERM): the socket is this thread's to close
                self._input.close()
                return
            try:
                request = decoder.decode(frame)
            except msgspec.DecodeError as exc:  # not a request we can run: its caller, if any, hears why
                self._refuse(frame, exc)
                continue
            if isinstance(request, ipc.AddRequest):
                self.commands.put((functools.partial(_add, request), _Reply(self, request.call_id)))
                if cutter is not None:  # after the put: a request the step already holds cannot cut it
                    cutter.offer(request.params.priority)
            elif isinstance(request, ipc.FinishRequests):
                self.commands.put(functools.partial(_finish, request))
            else:
                self.commands.put(STOP)

    def _refuse(self, frame: bytes, exc: msgspec.DecodeError) -> None:
        """A frame that does not decode as a request (a value ``SamplingParams`` refuses, a client of another
        version): answer its call with the error when the frame names one (``[tag, call_id, ...]``), else log it."""
        try:
            head = msgspec.msgpack.decode(frame)
            call_id = head[1] if isinstance(head, list) and head[:1] in (["add"], ["call"]) else None
        except Exception:  # noqa: BLE001 - not even msgpack
            call_id = None
        if type(call_id) is not int:
            logger.error("dropped a message that is not an engine request: %s", exc)
            return
        reply = _Reply(self, call_id)
        self.commands.put((functools.partial(_raise, ValueError(f"the engine could not read this request: {exc}")),
                           reply))

    # ---- StepLoop callbacks (engine loop thread) ----------------------------------------------------------
    def _publish(self, step: CoreStepOutput) -> None:
        self.message.step = step  # one step per round

    def _on_stats(self, stats: SchedulerStats) -> None:
        if stats != self._last_stats:
            self.message.stats = self._last_stats = stats

    def _on_step(self, record: StepRecord) -> None:
        record.num_scheduled_tokens = {}  # the slot timeline stays with offline benchmarks
        self.message.records.append(record)

    def _flush(self, timeout: float | None = None) -> None:
        """Send the round's message from the step loop's own thread. (An output thread, as vLLM has, to overlap
        encoding with the next step cost more than it saved: encoding a step is tens of microseconds, and handing
        the GIL to another thread and back about 1 ms a step, 10% of a batch-1 decode step.) Waits while the API
        process is OUTPUT_HWM messages behind (back-pressure), unless it is gone, or for longer than ``timeout``:
        then the message is dropped, since nobody would read it."""
        message, self.message = self.message, ipc.EngineMessage()
        if not message:
            return
        frame = self._encoder.encode(message)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._output.poll(POLL_MS, zmq.POLLOUT):
            if self.parent_gone.is_set() or (deadline is not None and time.monotonic() > deadline):
                logger.error("the API process takes no messages: dropped one")
                return
        self._output.send(frame, zmq.NOBLOCK)


def _raise(exc: BaseException, engine: LLMEngine | None = None):
    raise exc


def start_supervised(core: EngineCore, name: str, body) -> threading.Thread:
    """Run ``body`` in a thread; if it raises, the step loop raises the same on its next round (a command), so the
    engine dies as when a step raises: a last message saying why, exit status 1."""
    def run() -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - a dead thread must end the process, never wedge it
            why = RuntimeError(f"the engine process's {name} thread died: {exc!r}")
            core.commands.put(functools.partial(_raise, why))

    thread = threading.Thread(target=run, name=f"conveyor-engine-{name}", daemon=True)
    thread.start()
    return thread


def _watch_parent(conn, core: EngineCore) -> None:
    """The start-up pipe carries nothing after "ready": it closes when the API process is gone, however it went.
    Polled, so that the thread runs Python now and then (a fault in it surfaces instead of hiding in a read)."""
    try:
        while not conn.poll(PARENT_POLL_S):
            pass
        conn.recv()
    except (EOFError, OSError):
        pass
    core.parent_gone.set()
    core.commands.put(STOP)


def run_engine_core(args: EngineArgs, conn, endpoints: ipc.Endpoints) -> None:
    """The engine core process's entry point: build the engine, say ("ready", (EngineInfo, SchedulerStats)) on
    the start-up pipe, then serve the sockets at ``endpoints``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server owns shutdown: it drains, then sends Shutdown
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s[core]: %(message)s")
    try:
        from conveyor.engine.llm_engine import LLMEngine

        engine = LLMEngine(args)
    except BaseException as exc:  # noqa: BLE001 - the server raises it (the same error an engine in it would)
        conn.send(("failed", exc if picklable(exc) else RuntimeError(f"the engine could not start: {exc!r}")))
        sys.exit(1)
    conn.send(("ready", (engine.info.portable(), engine.scheduler.make_stats())))
    code = serve_engine(engine, conn, endpoints)
    # Its sockets are closed and what they held has left: skip the interpreter's teardown of torch, the model
    # and the thread pools, which the API process's shutdown waits for (over 3 s with both cores kept busy).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve_engine(engine: LLMEngine, conn, endpoints: ipc.Endpoints) -> int:
    """Serve the API process at ``endpoints`` until told to stop, or until ``conn`` (the start-up pipe) closes
    (0), or the engine raises (1, after a last message saying why)."""
    context = zmq.Context()
    engine.structured.prepare()  # before requests arrive, so the first constrained one stalls nobody
    core = EngineCore(engine, endpoints, context)
    start_supervised(core, "parent", functools.partial(_watch_parent, conn, core))
    try:
        core.run()
        return 0
    except BaseException:  # noqa: BLE001 - a crashed engine must fail every waiting client
        logger.exception("the engine core crashed")
        return 1
    finally:
        context.term()  # after the threads closed their sockets, and what the output socket held has left
