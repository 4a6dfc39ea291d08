"""The engine core in a process of its own (what ``conveyor serve`` runs), as vLLM v1 runs its EngineCore.

Why a process: in one process the step loop and the event loop (HTTP, JSON, SSE) take turns on one GIL, and every
torch op of a step gives the GIL up and must win it back; a busy event loop then stretches the step. Here the
engine owns its interpreter and talks to the server over one pipe (``multiprocessing.Pipe``):

    server process (event loop)                        engine core process
    ("call", id, fn) / ("abort", id) / ("stop",) -->   reader thread -> command queue
                                                       StepLoop: [commands] -> step() -> ...
    loop.add_reader wakes once per message <--------   ("step", StepMessage): every output of the step as a delta,
                                                       the command replies, step records, the stats snapshot

At most one message per round of commands and step. The process ignores SIGINT and SIGTERM (the server drains
and then says "stop"); it exits when told, when the pipe closes (the server is gone), or, after sending
("dead", why), when the engine raises.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
import types
from dataclasses import dataclass, field
from typing import Any

from conveyor.core.outputs import SchedulerStats
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.output_delta import DeltaEncoder, OutputDelta
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.step_loop import STOP, StepLoop
from conveyor.engine.step_record import StepRecord

logger = logging.getLogger("conveyor.engine")


@dataclass
class EngineInfo:
    """What the server needs to know of the engine, sent once when it is ready."""

    model_info: Any  # ModelInfo's fields as a SimpleNamespace: the server need not import torch to read it
    max_model_len: int
    num_kv_blocks: int
    max_seqs_per_request: int | None
    stats: SchedulerStats
    pid: int
    load_time_s: float  # tokenizer + weights
    init_time_s: float  # plus the KV cache and runner
    tokenizer: Any  # the engine's tokenizer, so the server need not load it (and import torch); None: load it
    random_weights: bool  # the embedded bench model: the server warns that its output is noise


@dataclass
class StepMessage:
    """Everything one round of commands and step produced, in one message."""

    outputs: list[OutputDelta] = field(default_factory=list)
    replies: list[tuple[int, bool, Any]] = field(default_factory=list)  # (call id, ok, result or exception)
    records: list[StepRecord] = field(default_factory=list)
    stats: SchedulerStats | None = None

    def __bool__(self) -> bool:
        return bool(self.outputs or self.replies or self.records or self.stats is not None)


def add_request_command(request_id: str, prompt, params, arrival: float, engine: LLMEngine) -> None:
    """The add command (picklable as a ``functools.partial``; the engine comes last)."""
    engine.add_request(request_id, prompt, params, arrival)


class _Reply:
    """The future-like end of a call: its result goes into the message being filled when the call runs."""

    def __init__(self, core: "EngineCore", call_id: int) -> None:
        self.core, self.call_id = core, call_id

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def set_result(self, value) -> None:
        self.core.message.replies.append((self.call_id, True, value))

    def set_exception(self, exc: BaseException) -> None:
        self.core.message.replies.append((self.call_id, False, exc))


class EngineCore:
    """Runs the ``StepLoop`` on commands read from ``conn`` and sends one ``StepMessage`` per round."""

    def __init__(self, engine: LLMEngine, conn) -> None:
        self.engine = engine
        self.conn = conn
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.message = StepMessage()
        self.encoder = DeltaEncoder()
        self._last_stats: SchedulerStats | None = None
        engine.step_listeners.append(self._on_step)
        self.loop = StepLoop(engine, self.commands, self._publish, self._on_stats, self._flush)

    def run(self) -> None:
        threading.Thread(target=self._read, name="conveyor-engine-reader", daemon=True).start()
        self.loop.run()
        self._flush()

    def _read(self) -> None:
        """Pipe -> command queue, so the server's sends never wait for a step to end."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.commands.put(STOP)  # the server is gone
                return
            kind = msg[0]
            if kind == "call":
                _, call_id, fn = msg
                self.commands.put((fn, _Reply(self, call_id)))
            elif kind == "abort":
                request_id = msg[1]
                self.commands.put(lambda e: self.loop.abort(e, request_id))
            else:
                self.commands.put(STOP)
                return

    # ---- StepLoop callbacks (engine loop thread) ----------------------------------------------------------
    def _publish(self, outputs: list[RequestOutput]) -> None:
        self.message.outputs.extend(self.encoder.encode(out) for out in outputs)

    def _on_stats(self, stats: SchedulerStats) -> None:
        if stats != self._last_stats:
            self.message.stats = self._last_stats = stats

    def _on_step(self, record: StepRecord) -> None:
        record.num_scheduled_tokens = {}  # the slot timeline stays with offline benchmarks
        self.message.records.append(record)

    def _flush(self) -> None:
        message, self.message = self.message, StepMessage()
        if not message:
            return
        try:
            data = pickle.dumps(("step", message), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - a call returned something that cannot travel: say so, to its caller
            message.replies = [(i, ok if _picklable(v) else False, v if _picklable(v) else
                                RuntimeError(f"the call's result cannot be sent: {v!r}"[:500]))
                               for i, ok, v in message.replies]
            data = pickle.dumps(("step", message), protocol=pickle.HIGHEST_PROTOCOL)
        self.conn.send_bytes(data)


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
        return True
    except Exception:  # noqa: BLE001
        return False


def run_engine_core(args: EngineArgs, conn) -> None:
    """The engine core process's entry point: build the engine, say ("ready", EngineInfo), serve commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server owns shutdown: it drains, then sends "stop"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s[core]: %(message)s")
    try:
        engine = LLMEngine(args)
    except BaseException as exc:  # noqa: BLE001 - the server raises it (the same error an engine in it would)
        conn.send(("failed", exc if _picklable(exc) else RuntimeError(f"the engine could not start: {exc!r}")))
        sys.exit(1)
    from conveyor.models import EMBEDDED_NAME

    model_info = types.SimpleNamespace(**dataclasses.asdict(engine.model_info))
    conn.send(("ready", EngineInfo(model_info, engine.max_model_len, engine.num_kv_blocks,
                                   engine.max_seqs_per_request, engine.scheduler.make_stats(), os.getpid(),
                                   engine.load_time_s, engine.init_time_s,
                                   engine.tokenizer if _picklable(engine.tokenizer) else None,
                                   engine.model_info.name == EMBEDDED_NAME)))
    sys.exit(serve_engine(engine, conn))


def serve_engine(engine: LLMEngine, conn) -> int:
    """Serve commands from ``conn`` until told to stop (0) or the engine raises (1, after ("dead", why))."""
    try:
        EngineCore(engine, conn).run()
        return 0
    except BaseException as exc:  # noqa: BLE001 - a crashed engine must fail every waiting client
        logger.exception("the engine core crashed")
        try:
            conn.send(("dead", f"{exc!r}\n{traceback.format_exc()}"))
        except OSError:
            pass
        return 1
