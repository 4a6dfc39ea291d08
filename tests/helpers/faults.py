"""Faults injected into a running server's threads, to check that a dying thread ends the process or is survived,
never wedges it: an exception raised inside a named thread (``PyThreadState_SetAsyncExc``, what a bug in that
thread's code would raise), in this process or, through ``EngineCoreClient.call``, in the engine core process."""

from __future__ import annotations

import ctypes
import threading


class InjectedFault(Exception):
    """The exception a test raises inside a serving thread."""


def raise_in_thread(name: str) -> str:
    """Raise ``InjectedFault`` in the live thread called ``name`` (when it next runs Python code); returns the name.
    Module-level, so that ``functools.partial(raise_in_thread, name)`` pickles for ``EngineCoreClient.call``."""
    found = [t for t in threading.enumerate() if t.name == name]
    assert len(found) == 1, f"threads named {name!r}: {[t.name for t in threading.enumerate()]}"
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(found[0].ident),
                                                      ctypes.py_object(InjectedFault))
    assert done == 1, f"PyThreadState_SetAsyncExc reached {done} threads"
    return name


def raise_in_engine_thread(name: str, engine) -> str:
    """``raise_in_thread`` as an ``EngineCoreClient.call`` function (it gets the engine, and ignores it)."""
    return raise_in_thread(name)
