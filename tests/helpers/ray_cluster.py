"""A Ray cluster on loopback for the scale-out tests (``ray start --head`` as users run it), and waits with
hang guards. Import only where Ray is installed (the tests importorskip it first)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from conveyor.distributed.launch import start_ray

# The test's own cluster: no token authentication (`ray start` turns it on when ~/.ray/auth_token exists, and a
# client joining an explicit address sends the token only under RAY_AUTH_MODE=token, see launch.RayJoinError), and
# no 30 s drain when the head is told to stop.
# Read while the tests are collected: an engine built in this process later pins its OpenMP threads, the main
# thread among them, to one CPU each, and children inherit the CPUs of the thread that starts them.
ALLOWED_CPUS = sorted(os.sched_getaffinity(0))
HEAD_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def ray_head(num_cpus: int):
    """A Ray cluster as users start one (``ray start --head``, blocking, so that ending this process ends it),
    on loopback, in its own temp dir (it never becomes this machine's "current cluster"), without token
    authentication whatever ~/.ray holds; yields its GCS address."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live under it
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", "--node-ip-address",
           "127.0.0.1", "--port", str(port), "--num-cpus", str(num_cpus), "--include-dashboard=false",
           "--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port()),
           "--temp-dir", temp_dir, "--disable-usage-stats"]
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, ALLOWED_CPUS)  # the cluster (and the replicas it starts) inherits this thread's CPUs
    try:
        head = subprocess.Popen(cmd, env={**os.environ, **HEAD_ENV}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    finally:
        os.sched_setaffinity(0, saved)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()  # its handler stops every process of the cluster
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def join(address: str, timeout_s: float = 60.0) -> None:
    """``start_ray(address)`` once the head answers (``ray start`` returns before its GCS listens)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)
    start_ray(address, num_cpus=0)


HANG_GUARD_S = 300.0


def wait_for(condition, what: str, timeout_s: float = HANG_GUARD_S):
    """Poll ``condition``; the deadline only guards against a hang (Ray Serve replacing a replica took over 90 s
    with both cores of the machine kept busy by another process)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


def health(url: str) -> dict:
    r = httpx.get(url + "/health", timeout=10)
    return r.json() if r.status_code == 200 else {"replicas": [], "status": r.status_code}
