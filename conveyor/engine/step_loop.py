"""The loop that steps an ``LLMEngine`` while work exists and runs commands between steps, wherever the engine
lives: a thread of the server (``AsyncEngine``) or a process of its own (``engine.core_proc``).

Commands arrive on a ``queue.SimpleQueue``: ``STOP``; a plain ``fn(engine)``; or ``(fn, future)``, whose result
or exception goes to the future (anything with ``concurrent.futures.Future``'s ``set_running_or_notify_cancel``,
``set_result`` and ``set_exception``). Commands run only between steps, so an abort frees its blocks before the
next step, and each step's outputs are handed to ``publish`` at once, in one call. What a step is: the whole
``engine.step`` (outputs processed: the thread), or ``engine.core_step`` (tokens only: the engine core process,
whose outputs the API process processes).
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from conveyor.core.outputs import SchedulerStats
from conveyor.core.config import IDLE_POLL_S

if TYPE_CHECKING:  # annotations only: the API process imports this module without torch
    from conveyor.engine.llm_engine import LLMEngine

STOP = object()


class StepLoop:
    """``run()`` returns when a ``STOP`` command arrives; it raises what kills the engine (the caller reports it).

    ``publish(outputs)`` gets every step's non-empty outputs (and an abort's); ``on_stats(stats)`` the scheduler's
    snapshot after every step and every command; ``on_iteration()`` (optional) after each round of commands and
    step, so a caller that batches what the callbacks gave (the engine core process) sends it once per step.
    """

    def __init__(self, engine: LLMEngine, commands: queue.SimpleQueue,
                 publish: Callable[[Any], None], on_stats: Callable[[SchedulerStats], None],
                 on_iteration: Callable[[], None] | None = None, step: Callable[[], Any] | None = None) -> None:
        self.engine = engine
        self.step = step or engine.step
        self.commands = commands
        self.publish = publish
        self.on_stats = on_stats
        self.on_iteration = on_iteration

    def abort(self, engine: LLMEngine, request_id: str) -> None:
        """The abort command: its output (finish_reason "abort") is published like a step's."""
        out = engine.abort_request(request_id)
        if out is not None:
            self.publish([out])

    def run(self) -> None:
        engine = self.engine
        idle_wait = 0.0
        while True:
            # Block while idle; while requests run, just take what has arrived since the last step.
            timeout = idle_wait if engine.has_unfinished_requests() else None
            if not self._run_commands(timeout):
                return
            idle_wait = 0.0
            if engine.has_unfinished_requests():
                outputs = self.step()
                if outputs:
                    self.publish(outputs)
                elif not engine.scheduler.num_running:
                    idle_wait = IDLE_POLL_S  # waits for commands meanwhile, instead of spinning
                self.on_stats(engine.scheduler.make_stats())
            if self.on_iteration is not None:
                self.on_iteration()

    def _run_commands(self, timeout: float | None) -> bool:
        """Run queued commands, waiting up to ``timeout`` s for the first (None: forever). False: stop."""
        try:
            command = self.commands.get(timeout=timeout) if timeout != 0.0 else self.commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is STOP:
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
            self.on_stats(self.engine.scheduler.make_stats())  # a command may have added, aborted, ...
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return True
