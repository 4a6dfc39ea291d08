"""``EngineCoreClient``: the server's end of an engine core running in its own process (``engine.core_proc``).

It starts the process (spawn: a fresh interpreter, so no torch thread pool is inherited half-initialised), waits
for it to be ready, and then lives on the event loop: the pipe is registered with ``loop.add_reader``, so the loop
wakes once per message (one per engine step) and delivers every stream's output of that step in one go. Prompts
are prepared (tokenized, chat-rendered, length-checked) here, with a copy of the engine's tokenizer that came with
its "ready" message (so this process need not import torch to load one).

If the process dies (it raised, or was killed), every in-flight stream and pending call gets
``EngineDeadError`` and the ``on_dead`` callbacks run: the server then exits with status 1, as with a crashed
engine thread.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import multiprocessing
import time
from collections.abc import Callable
from typing import Any

from conveyor.core.outputs import SchedulerStats
from conveyor.engine.args import EngineArgs
from conveyor.engine.core_proc import EngineInfo, StepMessage, add_request_command, run_engine_core
from conveyor.engine.engine_client import EngineClient, EngineDeadError
from conveyor.engine.llm_engine import encode_text
from conveyor.engine.output_delta import DeltaDecoder

logger = logging.getLogger("conveyor.engine")

STARTUP_TIMEOUT_S = 600.0  # a big checkpoint on a slow disk; a failure is reported as soon as it happens
STOP_TIMEOUT_S = 30.0  # shutdown: how long the process may take to finish its step and exit before it is killed


class EngineView:
    """What the server reads of an engine in another process (all fixed for the run), and its tokenizer."""

    def __init__(self, args: EngineArgs, tokenizer, info: EngineInfo) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.model_info = info.model_info
        self.max_model_len = info.max_model_len
        self.num_kv_blocks = info.num_kv_blocks
        self.max_seqs_per_request = info.max_seqs_per_request
        self.pid = info.pid
        self.load_time_s, self.init_time_s = info.load_time_s, info.init_time_s
        self.random_weights = info.random_weights
        self.step_listeners: list[Callable] = []  # called on the event loop with each step's ``StepRecord``

    def encode(self, text: str, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        return encode_text(self.tokenizer, text, add_special_tokens, field)


class EngineCoreClient(EngineClient):
    """Starts the engine core process for ``args``; ``wait_ready()`` blocks until it has loaded the model (and
    raises if it could not), so the caller can import and build the server meanwhile.

    ``output_listeners`` are called on the event loop. ``call(fn)`` sends ``fn`` to the process: it must be
    picklable (a module-level function, a ``functools.partial`` or ``operator`` getter of one).
    """

    def __init__(self, args: EngineArgs, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._proc = context.Process(target=run_engine_core, args=(args, child_conn), name="conveyor-engine-core",
                                     daemon=True)
        self._proc.start()
        child_conn.close()
        self._args, self._startup_timeout_s, self._started = args, startup_timeout_s, time.monotonic()
        super().__init__(SchedulerStats())  # the engine's own stats arrive with "ready"
        self._decoder = DeltaDecoder()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._stopping = False
        self.engine: EngineView | None = None

    def wait_ready(self) -> EngineCoreClient:
        """Block until the engine process is ready; raise what building the engine raised there (or
        RuntimeError when the process died or timed out), and reap the process, if it cannot start."""
        if self.engine is None:
            try:
                info = self._wait_ready(self._startup_timeout_s - (time.monotonic() - self._started))
            except BaseException:
                self._proc.kill()
                raise
            self.stats = info.stats
            tokenizer = info.tokenizer
            if tokenizer is None:  # it could not travel: load our own copy
                from conveyor.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(self._args.model)
            self.engine = EngineView(self._args, tokenizer, info)
        return self

    def _wait_ready(self, timeout_s: float) -> EngineInfo:
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
        """Start reading the process's messages on the running event loop."""
        self.wait_ready()
        self._start_loop_side()
        self._loop.add_reader(self._conn.fileno(), self._on_readable)

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self._stopping and self._proc.is_alive()

    async def shutdown(self) -> None:
        """Abort whatever is left, tell the process to stop, and wait for it (kill it after STOP_TIMEOUT_S)."""
        self.stop_admissions()
        for request_id in list(self._streams):
            self.abort(request_id)
        if self.dead_error is None and not self._stopping:
            self._stopping = True
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
        await asyncio.to_thread(self._proc.join, STOP_TIMEOUT_S)
        if self._proc.is_alive():
            logger.warning("the engine core process did not stop within %.0f s: killing it", STOP_TIMEOUT_S)
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 5.0)
        self._close_pipe()

    # ---- requests ---------------------------------------------------------------------------------------
    async def _add(self, request_id: str, prompt, params, arrival: float) -> None:
        prompt = prompt(self.engine) if callable(prompt) else prompt  # tokenize here, not in the engine's step
        await self.call(functools.partial(add_request_command, request_id, prompt, params, arrival))

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when finished); its blocks are free before the next step runs."""
        if request_id in self._streams and self.is_running:
            try:
                self._conn.send(("abort", request_id))
            except OSError:
                pass  # the process is gone: its end of the pipe reports that

    async def tokenizer_call(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.engine)  # the server's own tokenizer: no round trip to the engine process

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` in the engine process between steps and return its result (or raise its error)."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        try:
            self._conn.send(("call", call_id, fn))
        except OSError as exc:
            self._calls.pop(call_id, None)
            raise EngineDeadError(f"the engine is not running: {exc!r}") from exc
        return await future

    # ---- event loop side --------------------------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                kind, payload = self._conn.recv()
                if kind == "step":
                    self._handle(payload)
                elif kind == "dead":
                    self._died(f"the engine core raised: {payload}")
                    return
        except (EOFError, OSError):
            if self._stopping:
                self._close_pipe()
            else:
                self._died(None)

    def _handle(self, message: StepMessage) -> None:
        if message.stats is not None:
            self.stats = message.stats
        for record in message.records:
            for listener in self.engine.step_listeners:
                listener(record)
        for call_id, ok, value in message.replies:
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                future.set_result(value) if ok else future.set_exception(value)
        if message.outputs:
            batch = [self._decoder.decode(delta) for delta in message.outputs]
            for out in batch:
                for listener in self.output_listeners:
                    listener(out)
            self._deliver(batch)

    def _died(self, why: str | None) -> None:
        if self.dead_error is not None:
            return
        self._close_pipe()
        self._proc.join(1.0)
        if why is None:
            why = f"the engine core process (pid {self._proc.pid}) exited with code {self._proc.exitcode}"
        logger.error("%s", why)
        cause = EngineDeadError(why.splitlines()[0])
        self.dead_error = cause
        error = EngineDeadError(f"the engine stopped: {cause!r}")
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)
        self._deliver_error(error, cause)

    def _close_pipe(self) -> None:
        if not self._conn.closed:
            if self._loop is not None:
                self._loop.remove_reader(self._conn.fileno())
            self._conn.close()
