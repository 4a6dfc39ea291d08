"""The engine pipe: typed msgpack frames (``msgspec``) over two ZeroMQ sockets, as vLLM v1's ``EngineCoreClient``
and ``EngineCoreProc`` talk.

    API process                                                    engine core process
    sender thread    --PUSH  ipc://.../input   PULL-->  input thread -> command queue -> step loop
    receiver task    <--PULL ipc://.../output  PUSH--   step loop (sends from its own thread)

A ZeroMQ message arrives whole or not at all, so no read can tear and no write can leave half a frame behind,
whatever the event loop does with file descriptors. Every socket is used by one thread only (the receiver task's
on the event loop through ``zmq.asyncio``, which watches only ZeroMQ's notification fd). The API process binds both sockets (it outlives the engine) and the engine
connects. Liveness is never read from the sockets: the API process watches the engine process itself. Every
queue on the output path is bounded (``OUTPUT_HWM``), so the output path has back-pressure end to end.

What crosses, and nothing else (``EngineRequest`` one way, ``EngineMessage`` the other):
"""

from __future__ import annotations

import os
import tempfile

import msgspec
import zmq

from conveyor.core.outputs import SchedulerStats
from conveyor.core.request import RequestStatus
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.core_step import CoreStepOutput
from conveyor.engine.step_record import StepRecord


# ---- API process -> engine core ---------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """Queue a request whose prompt the API process has tokenized and checked; answered by a ``Reply``."""

    call_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float


class FinishRequests(msgspec.Struct, tag="finish", array_like=True):
    """End these (child) requests in the scheduler: ``status`` FINISHED_ABORTED (a client left, a failure) or
    FINISHED_STOPPED (the API process's stop-string check ended them)."""

    request_ids: list[str]
    status: RequestStatus


class Shutdown(msgspec.Struct, tag="stop", array_like=True):
    """Finish the current step, send what it produced, exit 0."""


EngineRequest = AddRequest | FinishRequests | Shutdown


# ---- engine core -> API process ---------------------------------------------------------------------------
class Reply(msgspec.Struct, array_like=True):
    """The answer to an ``AddRequest``: queued (``error`` None), or refused: (exception class name, message)."""

    call_id: int
    error: tuple[str, str] | None = None


class EngineMessage(msgspec.Struct, array_like=True):
    """One round of commands and step: the step's tokens, the command replies, the step records, the stats
    snapshot (when it changed), and, last of all from a crashing engine, why it died."""

    step: CoreStepOutput | None = None
    replies: list[Reply] = []
    records: list[StepRecord] = []
    stats: SchedulerStats | None = None
    dead: str | None = None

    def __bool__(self) -> bool:
        return bool(self.step or self.replies or self.records or self.stats is not None or self.dead)


# Exceptions a reply may carry, rebuilt as themselves on the API side (anything else is a RuntimeError).
def _error_types() -> dict[str, type[BaseException]]:
    from conveyor.engine.engine_client import QueueFullError

    return {t.__name__: t for t in (ValueError, QueueFullError, KeyError, TypeError, RuntimeError)}


def error_reply(call_id: int, exc: BaseException) -> Reply:
    return Reply(call_id, (type(exc).__name__, str(exc)[:10_000]))


def raise_error(reply: Reply) -> None:
    """Raise the reply's error, as the engine raised it when its type is a known one (else a RuntimeError)."""
    if reply.error is not None:
        name, message = reply.error
        raise _error_types().get(name, RuntimeError)(message)


# ---- sockets ----------------------------------------------------------------------------------------------
LINGER_S = 5.0  # at close, how long a socket may go on delivering what it has queued (a dead peer: dropped then)

class Endpoints(msgspec.Struct):
    """The two socket addresses, in a private directory of the API process."""

    input: str
    output: str

    @classmethod
    def fresh(cls) -> Endpoints:
        where = tempfile.mkdtemp(prefix="conveyor-ipc-")
        return cls(f"ipc://{where}/input", f"ipc://{where}/output")

    def remove(self) -> None:
        for address in (self.input, self.output):
            path = address.removeprefix("ipc://")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(os.path.dirname(self.input.removeprefix("ipc://")))
        except OSError:
            pass


# Messages the output direction may hold in ZeroMQ's queues on each side. With the engine's bounded outbox and the
# API process's bounded hand-off to its event loop, an API process that falls behind makes the engine's step loop
# wait instead of letting a queue anywhere grow without bound. The input direction has no limit: the engine's
# input thread takes everything at once, and what it holds is bounded by the server's own admission limits.
OUTPUT_HWM = 16


def make_socket(context: zmq.Context, kind: int, address: str, bind: bool, hwm: int = 0) -> zmq.Socket:
    """A blocking socket holding at most ``hwm`` messages (0: no limit) that drops nothing it has queued for up to
    ``LINGER_S`` at close."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, int(LINGER_S * 1000))
    sock.bind(address) if bind else sock.connect(address)
    return sock


# One encoder or decoder per thread that uses it (each keeps buffers of its own).
def request_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineRequest)


def message_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineMessage)
