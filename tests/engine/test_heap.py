"""``engine.heap.release_free_heap``: freed heap pages that glibc keeps resident go back to the system."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a fresh interpreter: raise glibc's mmap threshold as loading a model does (a large block freed), leave 180
# MiB of freed 1 MiB blocks pinned between live ones (so the heap's top cannot shrink by itself), then trim.
SCRIPT = """
import sys
from conveyor.engine.heap import release_free_heap

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

big = b"x" * (16 << 20)  # under glibc's 32 MiB cap on the threshold it raises
del big
blocks = [b"y" * (1 << 20) for _ in range(200)]
keep = blocks[9::10]
del blocks
before = rss_mib()
trimmed = release_free_heap()
print(trimmed, before - rss_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim; elsewhere a no-op")
def test_release_free_heap_returns_freed_pages_to_the_system():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    trimmed, released_mib = out.stdout.split()
    assert trimmed == "True"
    assert float(released_mib) > 100, out.stdout  # 180 MiB were free; the live 20 stay
