"""Faults injected into a running server's threads, to check that a dying thread ends the process or is survived,
never wedges it: an exception raised inside a named thread (``PyThreadState_SetAsyncExc``, what a bug in that
thread's code would raise), in this process or, on a signal, in the engine core process (started with
``engine_core_with_faults``, its entry point wrapped)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

from conveyor.engine.core_proc import run_engine_core

# The engine core process's threads a signal faults (engine_core_with_faults).
ENGINE_THREAD_SIGNALS = {"conveyor-engine-input": signal.SIGUSR1, "conveyor-engine-parent": signal.SIGUSR2}


class InjectedFault(Exception):
    """The exception a test raises inside a serving thread."""


def raise_in_thread(name: str) -> str:
    """Raise ``InjectedFault`` in the live thread called ``name`` (when it next runs Python code); returns the name."""
    found = [t for t in threading.enumerate() if t.name == name]
    assert len(found) == 1, f"threads named {name!r}: {[t.name for t in threading.enumerate()]}"
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(found[0].ident),
                                                      ctypes.py_object(InjectedFault))
    assert done == 1, f"PyThreadState_SetAsyncExc reached {done} threads"
    return name


# Each engine step of a faulted engine takes at least this long, so that a long stream is still in flight when a
# fault lands on a fast machine (a tiny model's 400 tokens otherwise end inside a watcher's poll period).
STEP_FLOOR_S = 0.01


def engine_core_with_faults(args, conn, endpoints) -> None:
    """``run_engine_core`` (an ``EngineCoreClient`` ``entry``) in a process where each signal of
    ``ENGINE_THREAD_SIGNALS`` raises ``InjectedFault`` in its thread (the handler runs on the main thread), and each
    engine step lasts at least ``STEP_FLOOR_S``."""
    from conveyor.engine.llm_engine import LLMEngine

    step = LLMEngine.core_step

    def slow_step(self, *a, **kw):
        out = step(self, *a, **kw)
        time.sleep(STEP_FLOOR_S)
        return out

    LLMEngine.core_step = slow_step
    for name, signum in ENGINE_THREAD_SIGNALS.items():
        signal.signal(signum, lambda *_, name=name: raise_in_thread(name))
    run_engine_core(args, conn, endpoints)


def raise_in_engine_thread(pid: int, name: str) -> None:
    """Fault the thread ``name`` of the engine core process ``pid`` (started with ``engine_core_with_faults``)."""
    os.kill(pid, ENGINE_THREAD_SIGNALS[name])
