"""The engine as the server sees it: ``ServedEngine``, the one interface ``build_app`` serves, with
``EngineInfo``, the engine's facts fixed for the run; and ``EngineClient``, the event-loop side that every
implementation shares: one async output stream per request, admission, graceful drain, and failing every stream
when the engine dies.

Three engines implement it, each an ``EngineClient`` subclass that provides the transport (``start``,
``is_running``, ``abort``, ``shutdown``, ``_add``): ``AsyncEngine`` (an ``LLMEngine`` in a thread),
``EngineCoreClient`` (the engine core in its own process) and ``distributed.pool.ReplicaPool`` (Ray Serve
replicas behind one ingress).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import time
import types
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from conveyor.core.outputs import SchedulerStats
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.prompts import PromptType, encode_text, prompt_tokens
from conveyor.engine.step_record import StepRecord

logger = logging.getLogger("conveyor.engine")

DRAIN_ABORT_GRACE_S = 10.0  # after the drain deadline aborts what is left: how long the aborts may take


T = TypeVar("T")


@dataclass(frozen=True)
class EngineInfo:
    """What the server reads of an engine: all fixed for the run. ``LLMEngine.info`` makes it; the engine core
    process sends it with "ready", and each Ray replica on request (``portable``)."""

    args: EngineArgs
    tokenizer: Any  # None only in transit (``portable``), where it could not travel: see ``loaded``
    model_info: Any  # models.ModelInfo, or its fields as a SimpleNamespace where it crossed a process
    max_model_len: int
    max_seqs_per_request: int | None  # the most sequences the queue bound can ever admit at once (None: no bound)
    num_kv_blocks: int
    pid: int  # the engine's process (a replica pool's: the replica that answered)
    load_time_s: float  # tokenizer + weights
    init_time_s: float  # plus the KV cache and runner
    random_weights: bool  # the embedded bench model: the server warns that its output is noise
    # What a prefix-cache hit saves, from the model: (FLOPs per token through the layers, FLOPs per key attended);
    # a hit of H tokens skips a * H + b * H(H+1)/2 (StepRecord.saved_attended_keys). Zeros: unknown.
    prefix_hit_flops: tuple[float, float] = (0.0, 0.0)

    def encode(self, text: str, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        """Token ids of ``text``, as the engine's own ``encode`` (``prompts.encode_text``)."""
        return encode_text(self.tokenizer, text, add_special_tokens, field)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt as (text or None, token ids), as the engine's own ``tokenize_prompt``."""
        return prompt_tokens(self.tokenizer, prompt)

    def portable(self, with_tokenizer: bool = True) -> EngineInfo:
        """This, fit to send to another process that need not import torch: the model card as plain fields, the
        tokenizer only where it pickles (and ``with_tokenizer``)."""
        tokenizer = self.tokenizer if with_tokenizer and picklable(self.tokenizer) else None
        model_info = self.model_info
        if dataclasses.is_dataclass(model_info):  # (its PoolingConfig travels as it is: plain, frozen)
            model_info = types.SimpleNamespace(**{**dataclasses.asdict(model_info), "pooling": model_info.pooling,
                                                  "lora_base": model_info.lora_base})
        return dataclasses.replace(self, tokenizer=tokenizer, model_info=model_info)

    def loaded(self) -> EngineInfo:
        """This, with a tokenizer: the one that travelled, or else one loaded here from ``args.model``."""
        if self.tokenizer is not None:
            return self
        from conveyor.tokenizer import load_tokenizer

        return dataclasses.replace(self, tokenizer=load_tokenizer(self.args.model))


def picklable(value) -> bool:
    try:
        pickle.dumps(value)
        return True
    except Exception:  # noqa: BLE001
        return False


Prepare = Callable[[EngineInfo], PromptType]  # a prompt made off the event loop, just before its add


class QueueFullError(RuntimeError):
    """The bounded waiting queue (``max_num_queued_reqs``) is full; retry later."""


class EngineDeadError(RuntimeError):
    """The engine crashed; no request can be served any more."""


class EngineShuttingDownError(RuntimeError):
    """The engine is shutting down and admits no new requests."""


class RequestFailedError(RuntimeError):
    """The engine could not process this one request (it survived; see ``RequestOutput.error``)."""


class RequestStream:
    """The outputs of one request, as the engine produces them: ``async for out in stream``, ending after the
    output with ``finished`` set, or raising the request's error (``RequestFailedError``, ``EngineDeadError``).

    What an output holds is the request's ``SamplingParams.output_kind``:

    - ``DELTA`` (what a streaming handler asks for): only what is new since the previous output: the completions
      that changed, each with its new ``text`` (stop-string hold-back applied: nothing given is ever taken back),
      ``token_ids``, ``logprobs`` and ``token_times``, its ``finish_reason`` / ``stop_reason`` once it has
      finished, and where it starts (``text_start``, ``token_start``; ``num_tokens``: all its tokens so far). A
      reader that falls behind gets the deltas waiting for it joined into one: nothing is skipped.
    - ``CUMULATIVE`` (the default): everything so far; a reader that falls behind gets the newest.

    What the producer side has put here so far, whatever the kind: ``last`` (the newest output), and per
    completion index its tokens (``num_tokens``) and whether it has finished (``ended``);
    ``num_generated_tokens`` sums the tokens (a request's usage once its stream has ended).
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.last: RequestOutput | None = None
        self.num_tokens: dict[int, int] = {}
        self.ended: set[int] = set()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queue an output, or an error that ends the stream; an output with ``error`` set is that request's
        ``RequestFailedError``."""
        if isinstance(item, RequestOutput):
            self.last = item
            for c in item.outputs:
                self.num_tokens[c.index] = c.num_tokens
                if c.finished:
                    self.ended.add(c.index)
            if item.error is not None:
                item = RequestFailedError(item.error)
        self._queue.put_nowait(item)

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.num_tokens.values())

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty() and not isinstance(item, BaseException):
            newer = self._queue.get_nowait()  # a reader behind: join what waits (newest cumulative, deltas summed)
            item = newer if isinstance(newer, BaseException) else item.merged_with(newer)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


@runtime_checkable
class ServedEngine(Protocol):
    """What the server needs of an engine; ``build_app`` serves any implementation unchanged.

    ``info`` holds the facts fixed for the run; ``stats`` is the engine's latest immutable ``SchedulerStats``.
    ``add_request`` returns the request's stream; its ``prompt`` may be a ``Prepare``, which the implementation
    runs off the event loop just before the add (tokenizing, chat templates, length checks), with ``info``.
    ``tokenizer_call(fn)`` runs ``fn(info)`` off the event loop (``/tokenize``, ``/detokenize``). Listeners:
    ``output_listeners`` get every request's state after each step that changed it (a cumulative
    ``RequestOutput``, whatever the stream's kind: read it in the call), ``step_listeners`` every ``StepRecord``
    (metrics; each
    implementation says on which thread, and either may never be called where the numbers come another way, as
    for the replica pool); ``on_dead`` callbacks run on the event loop, once, when the engine has died.
    """

    stats: SchedulerStats
    dead_error: BaseException | None
    output_listeners: list[Callable[[RequestOutput], None]]
    step_listeners: list[Callable[[StepRecord], None]]
    on_dead: list[Callable[[BaseException], None]]

    @property
    def info(self) -> EngineInfo: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def num_in_flight(self) -> int: ...

    def start(self) -> None:
        """Start serving, on the event loop that will consume the streams."""

    async def add_request(self, request_id: str, prompt: PromptType | Prepare, params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    def fail_request(self, request_id: str, error: BaseException) -> None:
        """End a request's stream with ``error`` (its reader raises it) and abort the request."""

    async def tokenizer_call(self, fn: Callable[[EngineInfo], T]) -> T: ...

    def stop_admissions(self) -> None: ...

    async def drain(self, timeout_s: float) -> None: ...

    async def shutdown(self) -> None: ...


class EngineClient:
    """``ServedEngine``'s streams, admission and drain, written once; the transport to the engine is the
    subclass's, and so is ``info``.

    ``output_listeners`` and ``step_listeners`` are called where the subclass says; they must be quick.
    Callbacks in ``on_dead`` are called on the event loop, once, with the exception that killed the engine,
    after every in-flight stream got its error (the server exits then, so that a supervisor restarts it).
    ``stats`` is the engine's latest immutable ``SchedulerStats``.
    """

    info: EngineInfo

    def __init__(self, stats: SchedulerStats) -> None:
        self.output_listeners: list[Callable[[RequestOutput], None]] = []
        self.step_listeners: list[Callable[[StepRecord], None]] = []
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

    def start(self) -> None:
        """Start serving; call from the event loop that will consume the streams (``_start_loop_side`` first)."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when finished); its stream ends with finish_reason "abort"."""
        raise NotImplementedError

    async def shutdown(self) -> None:
        """Abort whatever is left and stop the engine."""
        raise NotImplementedError

    async def tokenizer_call(self, fn: Callable[[EngineInfo], T]) -> T:
        """Run ``fn(info)`` off the event loop, with the server's own tokenizer (``/tokenize``, ``/detokenize``)."""
        return await asyncio.to_thread(fn, self.info)

    async def _add(self, request_id: str, prompt: PromptType | Prepare, params: SamplingParams,
                   arrival: float) -> None:
        """Hand the request to the engine (its stream is registered already); run ``prompt(info)`` first when it
        is a ``Prepare``. Raise what refused it."""
        raise NotImplementedError

    def fail_request(self, request_id: str, error: BaseException) -> None:
        """End a request's stream with ``error`` (its reader raises it) and abort the request: a server's decision
        about a request in flight (admission judging it can no longer meet its target). Call on the event loop;
        a no-op for a finished request."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        self.abort(request_id)  # (its abort output, if it comes now, is read before the error)
        stream.put(error)
        self._forget(request_id)

    def _start_loop_side(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()

    def _abort_all(self) -> None:
        """Refuse new requests and abort every one in flight (the start of every ``shutdown``)."""
        self.stop_admissions()
        for request_id in list(self._streams):
            self.abort(request_id)

    # ---- lifecycle --------------------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def stop_admissions(self) -> None:
        """New requests are refused with ``EngineShuttingDownError`` from now on."""
        self._accepting = False

    async def drain(self, timeout_s: float) -> None:
        """Graceful shutdown: refuse new requests, let in-flight ones finish for up to ``timeout_s``, then abort
        the rest (their streams end with finish_reason "abort") and wait up to ``DRAIN_ABORT_GRACE_S`` for the
        aborts to land."""
        self.stop_admissions()
        if self._idle.is_set():  # nothing in flight (and wait_for(..., 0) would time out even so)
            return
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
    async def add_request(self, request_id: str, prompt: PromptType | Prepare, params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """Queue a request; return its stream. Raises what ``LLMEngine.add_request`` raises (ValueError,
        QueueFullError), or EngineShuttingDownError / EngineDeadError.

        ``prompt`` may be a ``Prepare``, a function ``info -> prompt`` (tokenizing, chat templates, length
        checks), which the subclass runs off the event loop before the add.
        """
        return await self._open_stream(request_id, arrival_time,
                                       lambda arrival: self._add(request_id, prompt, params, arrival))

    async def _open_stream(self, request_id: str, arrival_time: float | None, add) -> RequestStream:
        """Register the request's stream, then ``await add(arrival)`` (hands it to the engine; raises what
        refused it); the admission checks and the clean-up on failure of every kind of add."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error!r}")
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down and accepts no new requests")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream  # before the command: the first output may come right after it
        self._idle.clear()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        try:
            await add(arrival)
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
                stream.put(out)
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
