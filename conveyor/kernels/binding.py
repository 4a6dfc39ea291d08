"""Thread placement for the native kernels: one OpenMP thread per allowed CPU for the thread that runs the
engine's steps (``CoreBinding``), and the rule for when to pin at all (``plan_core_binding``)."""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from conveyor.kernels.cpu_ops import CpuKernels


class _PoolState(threading.local):
    bound = False  # this thread's OpenMP pool is pinned


class CoreBinding:
    """One OpenMP thread per allowed CPU for whichever thread runs the engine's steps (the engine owns the
    machine's cores, as vLLM's CPU backend assumes). A thread's pool is pinned at its first step; the stepping
    thread itself, thread 0 of its pool, is pinned to the first CPU only while a step runs (``pinned()``), so
    neither it between steps nor the threads it starts, which inherit its CPU mask, are confined to one CPU.
    (Pinned for good, it confined them: a thread started after building an LLM ran it 2x slower, its own pool
    stuck on that CPU.)

    Why pin at all: on a shared machine an unpinned pool lets the scheduler stack both threads on one core while
    another process runs on the other, and then every parallel region of every layer waits at its barrier
    (measured here: a 2-thread run 2x slower in wall and CPU time than pinned while other processes competed
    for the cores)."""

    def __init__(self, kernels: CpuKernels, cpus: list[int]) -> None:
        self.kernels, self.cpus = kernels, cpus
        self._thread = _PoolState()

    @contextlib.contextmanager
    def pinned(self):
        """Run the body (a step) with this thread's pool pinned one thread per CPU; restore its own mask after."""
        saved = os.sched_getaffinity(0)
        if self._thread.bound:
            os.sched_setaffinity(0, self.cpus[:1])
        else:
            self.kernels.bind_threads(self.cpus)  # pins the pool, this thread (its thread 0) to cpus[0]
            self._thread.bound = True
        try:
            yield
        finally:
            os.sched_setaffinity(0, saved)


def plan_core_binding(kernels: CpuKernels | None) -> tuple[CoreBinding | None, str]:
    """A ``CoreBinding`` when torch's threads are as many as the CPUs this process may use (else None: they are
    left alone), and a line saying which."""
    if kernels is None or not hasattr(os, "sched_getaffinity"):
        return None, "threads not pinned (no native kernels)"
    cpus = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    if threads < 2 or threads != len(cpus):
        return None, f"threads not pinned ({threads} threads, {len(cpus)} CPUs allowed)"
    return CoreBinding(kernels, cpus), f"{threads} threads pinned one per CPU of {cpus} while a step runs"
