"""1 prefill + 1 decode replica against 2 colocated replicas (one pinned CPU each), same trace, same client; and
the simulator's prediction of both beside them (#29 item 4).

For each configuration in each round: start ``conveyor serve`` on Ray Serve (``--disaggregate 1P1D`` or
``--data-parallel-size 2``, ``--cpus-per-replica 1 --pin-replica-cpus``), warm it up with prompts that share
nothing with the trace, replay the trace with ``conveyor bench serve`` (the streaming client,
``bench/serve_client.py``), stop the server. Configurations alternate within each round so the machine's load
hits them alike; the 1-minute load average is recorded after each run. Then, with ``--profile``, the same trace
through ``conveyor bench compare --simulate PROFILE --disaggregate 2C,1P1D`` (the real schedulers on the
calibrated cost model of this machine; the KV link as ``scripts/kv_transfer_bench.py`` measured Ray's object
store here).

    PYTHONPATH=. .venv/bin/python scripts/disagg_bench.py --workload /tmp/lt.json --rounds 2 \
        --profile out/disagg/profile.json --json out/disagg/runs.json -- \
        --model conveyor-embedded-llama-40m-random --num-kv-blocks 448 --max-model-len 1024

Everything after ``--`` goes to every ``conveyor serve`` and to the simulator.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

PIN = ["--cpus-per-replica", "1", "--pin-replica-cpus"]
CONFIGS = {
    "1P1D": ["--disaggregate", "1P1D", *PIN],
    "2C": ["--data-parallel-size", "2", *PIN],
}
SIM_LAYOUT = {"1P1D": "1P1D@1", "2C": "2C@1"}
CONVEYOR = [sys.executable, "-m", "conveyor"]
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "out_tok_s", "req_s")


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200 and len(r.json()["replicas"]) == 2:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not become ready")


def warm_up(url: str) -> None:
    """A few requests whose tokens share nothing with any trace (ids below 3 are never drawn)."""
    for i in range(6):
        httpx.post(url + "/v1/completions", timeout=120,
                   json={"prompt": [1, 2] * (20 + 8 * i), "max_tokens": 8, "ignore_eos": True}).raise_for_status()


def busy_cores_s() -> float:
    """CPU seconds the whole machine has been busy (all CPUs, /proc/stat: everything but idle and iowait)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def tree_cpu_s(proc: subprocess.Popen) -> float:
    """CPU seconds of ``proc`` and its live descendants (the server, its Ray processes, the replicas)."""
    total = 0.0
    try:
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


def waited_children_cpu_s() -> float:
    """CPU seconds of this process's finished children (the benchmark client, once it has run)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def row(summary: dict) -> dict:
    return {"ttft_p50_ms": summary["ttft"]["p50"] * 1e3, "ttft_p99_ms": summary["ttft"]["p99"] * 1e3,
            "itl_p50_ms": summary["itl"]["p50"] * 1e3, "itl_p99_ms": summary["itl"]["p99"] * 1e3,
            "tpot_p50_ms": summary["tpot"]["p50"] * 1e3, "out_tok_s": summary["output_throughput"],
            "req_s": summary["request_throughput"], "failed": summary["num_failed"]}


def run_real(name: str, workload: str, port: int, serve_args: list[str]) -> dict:
    url = f"http://127.0.0.1:{port}"
    cmd = CONVEYOR + ["serve", "--port", str(port), "--disable-log-stats", "--uvicorn-log-level", "warning",
                      *CONFIGS[name], *serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, proc)
        warm_up(url)
        # Everyone else's CPU while the trace runs: the machine's busy time minus this server's and this client's.
        t0, busy0, mine0, client0 = time.monotonic(), busy_cores_s(), tree_cpu_s(proc), waited_children_cpu_s()
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run(CONVEYOR + ["bench", "serve", "--base-url", url, "--workload", workload,
                                       "--json", out.name], check=True, stdout=subprocess.DEVNULL)
            summary = json.load(open(out.name))["summary"]
        wall = time.monotonic() - t0
        mine = tree_cpu_s(proc) - mine0 + waited_children_cpu_s() - client0
        others = (busy_cores_s() - busy0 - mine) / wall
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"config": name, **row(summary), "load": os.getloadavg()[0], "others_cores": max(others, 0.0),
            "mine_cores": mine / wall}


def without_model(args: list[str]) -> list[str]:
    """Serve flags minus ``--model X``: the simulator takes the profile's model (the one it was calibrated on)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--model":
            skip = True
        elif not a.startswith("--model="):
            out.append(a)
    return out


def run_sim(profile: str, workload: str, link_gbps: float, serve_args: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = CONVEYOR + ["bench", "compare", "--simulate", profile, "--workload", workload, "--policies", "chunked",
                          "--disaggregate", ",".join(SIM_LAYOUT.values()), "--kv-link", "local-object-store",
                          "--kv-link-gbps", str(link_gbps), "--no-plots", "--no-warmup", "--out", out,
                          *without_model(serve_args)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        runs = json.load(open(os.path.join(out, "results.json")))["runs"]
    by_layout = {v: k for k, v in SIM_LAYOUT.items()}
    return [{"config": by_layout[r["label"].split()[0]], **row(r["summary"])} for r in runs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--profile", default=None, help="a `conveyor sim calibrate` profile: add the simulator's rows")
    p.add_argument("--link-gbps", type=float, default=6.8,
                   help="the simulated KV link (Gb/s): Ray's object store on this machine, kv_transfer_bench.py")
    p.add_argument("--json", default=None, help="write every run's numbers here")
    p.add_argument("serve_args", nargs="*", help="after --: flags for every conveyor serve (and the simulator)")
    ns = p.parse_args()
    names = ns.configs.split(",")
    runs = []
    for r in range(ns.rounds):
        for name in names:
            res = run_real(name, ns.workload, ns.port, ns.serve_args)
            res["round"] = r
            runs.append(res)
            print(json.dumps(res), file=sys.stderr, flush=True)
    sim = run_sim(ns.profile, ns.workload, ns.link_gbps, ns.serve_args) if ns.profile else []
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"real": runs, "simulated": sim}, f, indent=1)
    print("| config | source | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 | out tok/s | req/s | failed | load "
          "| others' cores | ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        for res in [x for x in runs if x["config"] == name]:
            print(f"| {name} | real, round {res['round'] + 1} | " + " | ".join(
                f"{res[k]:.0f}" if "ms" in k else f"{res[k]:.2f}" for k in METRICS) +
                  f" | {res['failed']} | {res['load']:.1f} | {res['others_cores']:.2f} | {res['mine_cores']:.2f} |")
        mine = [x for x in runs if x["config"] == name]
        if len(mine) > 1:
            print(f"| {name} | real, median | " + " | ".join(
                f"{statistics.median(x[k] for x in mine):.0f}" if "ms" in k else
                f"{statistics.median(x[k] for x in mine):.2f}" for k in METRICS) + " | | | | |")
        for res in [x for x in sim if x["config"] == name]:
            print(f"| {name} | simulated | " + " | ".join(
                f"{res[k]:.0f}" if "ms" in k else f"{res[k]:.2f}" for k in METRICS) + " | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
