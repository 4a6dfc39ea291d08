"""The memory budget of models on demand (``--max-loaded-memory GIB``): what a loaded model holds, and what one
about to load is expected to hold.

A loaded model is charged its engine process's resident memory, measured once it is ready (weights, KV cache,
the runtime: what unloading it gives back, since unloading ends that process). A model not loaded yet is charged
what it held the last time it was loaded, or, the first time, the size of its weight files (a lower bound: the
KV cache and the runtime come on top); once it has loaded, the measurement replaces the estimate and the pool
unloads idle models until the loaded ones fit again (``ModelPool._settle``).
"""

from __future__ import annotations

from pathlib import Path

import psutil

GIB = 1 << 30
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


def weight_files_bytes(path: str) -> int:
    """Bytes of the weight files at ``path``: a file's size, or a directory's weight files (its top level); 0
    for a name that is not a path (a packaged model)."""
    p = Path(path)
    try:
        if p.is_file():
            return p.stat().st_size
        if p.is_dir():
            return sum(f.stat().st_size for f in p.iterdir() if f.is_file() and f.suffix in WEIGHT_SUFFIXES)
    except OSError:
        pass
    return 0


def resident_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (0 if it is gone)."""
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


class MemoryBudget:
    """At most ``limit_bytes`` of loaded models (module doc). ``measure(pid)`` reads a ready engine's process."""

    def __init__(self, limit_bytes: int, measure=resident_bytes) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"--max-loaded-memory must be > 0, got {limit_bytes / GIB:g} GiB")
        self.limit_bytes, self.measure = limit_bytes, measure
        self.last_seen: dict[str, int] = {}  # name -> bytes it held when last loaded

    def expected(self, name: str, path: str) -> int:
        """What ``name`` is expected to hold once loaded."""
        return self.last_seen.get(name) or weight_files_bytes(path)

    def loaded(self, name: str, pid: int) -> int:
        """``name`` is ready in process ``pid``: its measured charge (remembered for its next load)."""
        self.last_seen[name] = charge = self.measure(pid)
        return charge
