"""Where an engine computes: its device, the CPUs and torch threads its process uses, and how the thread that runs
its steps is pinned while a step runs (``kernels.binding``)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager

from conveyor.engine.args import EngineArgs, parse_cpu_ids
from conveyor.engine.cpu_priority import apply_cpu_priority

logger = logging.getLogger("conveyor.engine")


def place(args: EngineArgs) -> str:
    """The engine's device ("auto": CUDA when available, else the CPU); on the CPU, this process confined to
    ``args.cpu_ids`` with one torch thread per CPU, or ``args.num_threads`` threads; its threads at
    ``args.cpu_priority``."""
    import torch

    apply_cpu_priority(args.cpu_priority)  # first: the threads torch starts from here on inherit it
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and args.cpu_ids:
        confine_to_cpus(args.cpu_ids, args.num_threads)
    elif device == "cpu" and args.num_threads:
        torch.set_num_threads(args.num_threads)
    return device


def confine_to_cpus(cpu_ids: str, num_threads: int | None = None) -> None:
    """Confine this process to ``cpu_ids`` with one torch thread per CPU (pinned later, as always when the threads
    match the CPUs). The server uses it to keep a CPU for its event loop (``--frontend-cpus``)."""
    import torch

    cpus = parse_cpu_ids(cpu_ids)
    allowed = os.sched_getaffinity(0)
    if not set(cpus) <= allowed:
        raise ValueError(f"cpu_ids {cpu_ids!r}: this process may only use CPUs {sorted(allowed)}")
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(num_threads or len(cpus))


def step_pinning(device: str, args: EngineArgs) -> Callable[[], AbstractContextManager]:
    """What a step runs inside: the CPU binding's ``pinned`` (``--cpu-bind-threads`` on the CPU, when the threads
    are as many as the CPUs), else nothing."""
    if device != "cpu" or not args.cpu_bind_threads:
        return contextlib.nullcontext
    from conveyor.kernels import load_cpu_kernels
    from conveyor.kernels.binding import plan_core_binding

    binding, said = plan_core_binding(load_cpu_kernels())
    logger.info("CPU: %s", said)
    return binding.pinned if binding is not None else contextlib.nullcontext
