"""Start-up to ready of ``conveyor serve``, engine in its own process against engine in a thread, alternated.

    python scripts/startup_time.py MODEL [ROUNDS]

Times each start until ``/v1/models`` answers 200, stops it with SIGTERM, and prints the times with the load
average at each start (docs/serving-latency.md).
"""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_start(model: str, in_thread: bool) -> tuple[float, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "conveyor.cli", "serve", "--model", model, "--port", str(port), "--disable-log-stats"]
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd + (["--engine-in-process"] if in_thread else []), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                    return round(time.monotonic() - t0, 2), round(load, 1)
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main() -> int:
    model, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
    times: dict[str, list] = {"thread": [], "process": []}
    for i in range(rounds):
        for mode in (["thread", "process"] if i % 2 == 0 else ["process", "thread"]):
            times[mode].append(time_start(model, mode == "thread"))
    print(times)  # (seconds to ready, load average at the start) per start
    return 0


if __name__ == "__main__":
    sys.exit(main())
