"""Where the engine computes: ``--cpu-ids`` confines its process (one pinned thread per CPU), and ``conveyor serve
--frontend-cpus N`` keeps N CPUs for the API server and gives the engine process the rest."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import httpx
import pytest

from conveyor.engine.args import EngineArgs, parse_cpu_ids
from conveyor.engine.core_client import EngineCoreClient
from conveyor.serve import split_cpus
from tests.helpers.server import TEST_DTYPE
from tests.server.test_serve_cli import start_server

# The CPUs this test process may use, read while the tests are collected: an engine built in this process later
# pins its OpenMP threads, the main thread among them, to one CPU each (as vLLM does), and children inherit the
# affinity of the thread that starts them.
ALLOWED = sorted(os.sched_getaffinity(0))


@contextlib.contextmanager
def on_every_allowed_cpu():
    """Start children from a main thread that may use every allowed CPU again (restored afterwards)."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, ALLOWED)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def test_cpu_lists_parse_as_linux_writes_them():
    assert parse_cpu_ids("1") == [1]
    assert parse_cpu_ids("0,2-3") == [0, 2, 3]
    assert parse_cpu_ids("3-4,1,4") == [1, 3, 4]
    for bad in ("", "a", "1-", "3-1", "1,,2", "-1"):
        with pytest.raises(ValueError, match="cpu_ids"):
            parse_cpu_ids(bad)


def allowed_cpus(pid: int) -> list[int]:
    with open(f"/proc/{pid}/status") as f:
        spec = next(line for line in f if line.startswith("Cpus_allowed_list:")).split(":", 1)[1].strip()
    return parse_cpu_ids(spec)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_engine_process_runs_on_its_cpus(tiny_llama_dir):
    last = ALLOWED[-1]
    args = EngineArgs(model=str(tiny_llama_dir), dtype=TEST_DTYPE, num_kv_blocks=64, block_size=16, cpu_ids=str(last))
    with on_every_allowed_cpu():
        core = EngineCoreClient(args).wait_ready()
        assert allowed_cpus(os.getpid()) == ALLOWED  # the parent is untouched
    try:
        assert allowed_cpus(core.info.pid) == [last]
    finally:
        import asyncio

        asyncio.run(core.shutdown())


def test_engine_refuses_cpus_it_may_not_use(tiny_llama_dir):
    outside = ALLOWED[-1] + 1
    args = EngineArgs(model=str(tiny_llama_dir), dtype=TEST_DTYPE, num_kv_blocks=64, cpu_ids=str(outside))
    with pytest.raises(Exception, match="may only use CPUs"):
        EngineCoreClient(args, startup_timeout_s=120).wait_ready()


def test_frontend_cpus_split_keeps_one_for_the_engine():
    cpus = sorted(os.sched_getaffinity(0))  # split_cpus reads the calling thread's CPUs, as serve's main thread
    ns = argparse.Namespace(frontend_cpus=len(cpus), engine_in_process=False)
    with pytest.raises(SystemExit, match="keep at least one"):
        split_cpus(ns, EngineArgs())
    with pytest.raises(SystemExit, match="own process"):
        split_cpus(argparse.Namespace(frontend_cpus=1, engine_in_process=True), EngineArgs())
    if len(cpus) >= 2:
        ns.frontend_cpus = 1
        assert split_cpus(ns, EngineArgs()) == ([cpus[0]], ",".join(map(str, cpus[1:])))
        assert split_cpus(ns, EngineArgs(num_threads=len(cpus) - 1))[0] == [cpus[0]]
        # more threads than the engine's CPUs wait on each other (8 tok/s against 200 on 2 CPUs): refused
        with pytest.raises(SystemExit, match="at most"):
            split_cpus(ns, EngineArgs(num_threads=len(cpus)))


@pytest.mark.slow
@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 CPUs to split")
def test_serve_with_a_frontend_cpu_answers(tiny_llama_dir, tmp_path):
    cpus = ALLOWED
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", str(tiny_llama_dir), "--dtype", "float32",
           "--num-kv-blocks", "64", "--frontend-cpus", "1", "--shutdown-timeout", "1"]
    with open(log_path, "w") as log:
        with on_every_allowed_cpu():  # as a shell starts it
            proc, url = start_server(cmd, log, log_path)
        try:
            body = {"model": httpx.get(url + "/v1/models").json()["data"][0]["id"], "prompt": [5, 6, 7],
                    "max_tokens": 5, "ignore_eos": True}
            done = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
            assert done["usage"]["completion_tokens"] == 5
            assert allowed_cpus(proc.pid) == cpus[:1]
        finally:
            proc.terminate()
            proc.wait(30)
    assert f"API server on CPUs {cpus[:1]}, engine on CPUs {','.join(map(str, cpus[1:]))}" in log_path.read_text()
