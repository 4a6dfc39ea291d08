"""``--cpu-priority`` / ``conveyor serve --embedding-cpu-priority``: the threads of a lowered process, those it
starts afterwards included (torch's workers are started after the engine lowers itself), run at the priority the
flag names, as /proc reads it; the served engine processes are checked in tests/server/test_server_embeddings.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conveyor.engine.cpu_priority import embedding_cpu_priority, thread_cpu_priority

LOWER_AND_START_THREADS = """
import json, os, sys, threading, torch
from conveyor.engine.cpu_priority import apply_cpu_priority, thread_cpu_priority
apply_cpu_priority(sys.argv[1])
torch.set_num_threads(2)
torch.ones(512, 512).sum()  # torch's OpenMP workers start now, from a lowered thread (little work: an idle
# process computes only on the cycles the rest of a busy machine leaves)
done = threading.Event()
worker = threading.Thread(target=done.wait); worker.start()
print(json.dumps({t: thread_cpu_priority(os.getpid(), int(t)) for t in os.listdir("/proc/self/task")}), flush=True)
os._exit(0)  # no interpreter teardown at the lowered priority (seconds of torch's on a busy machine)
"""


@pytest.mark.parametrize("priority", ["idle", "low", "normal"])
def test_every_thread_runs_at_the_priority_even_those_started_later(priority):
    out = subprocess.run([sys.executable, "-c", LOWER_AND_START_THREADS, priority], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"})
    assert out.returncode == 0, out.stderr[-2000:]
    threads = json.loads(out.stdout)
    assert len(threads) >= 2  # the main thread and the one it started (and torch's workers)
    inherited = thread_cpu_priority(os.getpid(), os.getpid())  # normal changes nothing: the test runner's
    assert set(threads.values()) == {inherited if priority == "normal" else priority}


def test_embedding_priority_auto_and_in_process():
    assert embedding_cpu_priority("auto", "normal", in_process=False) == "low"
    assert embedding_cpu_priority("low", "normal", in_process=False) == "low"
    assert embedding_cpu_priority("auto", "normal", in_process=True) == "normal"  # one process, one priority
    with pytest.raises(ValueError, match="--engine-in-process"):
        embedding_cpu_priority("idle", "normal", in_process=True)
