"""The CPU priority an engine's process computes at (``--cpu-priority``; ``conveyor serve --embedding-cpu-priority``).

An embedding engine served beside a chat engine shares the machine's cores with it; the kernel's scheduler is
already a priority scheduler, so the embedding engine yields by running at a lower priority than the chat
(``low`` by default, docs/embeddings.md has the measurements):

- ``normal``: the default scheduling class, nice as inherited (nothing is changed).
- ``low``: nice 19 (CFS/EEVDF weight 15 against a normal thread's 1024: about 1.5% of a contended core). What
  ``conveyor serve`` gives an embedding engine beside a generation model: on a quiet machine it kept the chat's
  TPOT within 10% of alone and embedded more than ``idle``, and it never starves the embeddings entirely.
- ``idle``: ``SCHED_IDLE`` (weight 3, and a waking normal thread preempts it at once): the engine runs on the
  cycles every other thread leaves; on a machine kept busy by other work it makes no progress at all.

Linux applies both per thread, and a thread inherits its creator's policy and nice value: ``apply_cpu_priority``
sets every thread the process has when it runs (before the engine loads its model, so torch's OpenMP pool and the
step loop are created from an already lowered thread), and every thread made after it inherits it. Lowering needs
no privilege; raising it back would, which is why the engine's own process (never the API server's) is lowered.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("conveyor.engine")

CPU_PRIORITIES = ("normal", "low", "idle")
LOW_NICE = 19


def apply_cpu_priority(priority: str) -> None:
    """Lower every thread of this process to ``priority`` (one of ``CPU_PRIORITIES``); threads started later
    inherit it. ``normal`` changes nothing."""
    if priority not in CPU_PRIORITIES:
        raise ValueError(f"cpu_priority: {priority!r} is not one of {', '.join(CPU_PRIORITIES)}")
    if priority == "normal":
        return
    for tid in _thread_ids():
        try:
            if priority == "idle":
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, tid, max(LOW_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    logger.info("CPU priority %s (%s) for this engine's threads", priority,
                "SCHED_IDLE" if priority == "idle" else f"nice {LOW_NICE}")


def embedding_cpu_priority(flag: str, chat_priority: str, in_process: bool) -> str:
    """``conveyor serve --embedding-cpu-priority``: "auto" puts the embedding engine's process below the chat
    engine's (low), unless both engines share the server's process (then it is the chat's: one process, one
    priority, and lowering the server would slow the chat too)."""
    if flag == "auto":
        return chat_priority if in_process else "low"
    if in_process and flag != chat_priority:
        raise ValueError("--embedding-cpu-priority: with --engine-in-process both engines compute in the server's "
                         "process, at one priority (--cpu-priority)")
    return flag


def thread_cpu_priority(pid: int, tid: int) -> str:
    """The priority a thread of process ``pid`` runs at, read from /proc as ``apply_cpu_priority`` names it."""
    fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    nice, policy = int(fields[16]), int(fields[38])  # stat fields 19 and 41 (man 5 proc), after pid and comm
    if policy == os.SCHED_IDLE:
        return "idle"
    return "low" if nice >= LOW_NICE else "normal"


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread only (and the threads it starts from now on)
        return [0]
