"""Where one decode step's wall time goes under the server (issue 8; the results are in docs/serving-latency.md).

The server is built exactly as ``conveyor serve`` builds it (``LLMEngine`` -> ``build_app`` -> ``make_server``) and
runs in this process, with timers wrapped around the pieces of the path (attributes of the live objects; nothing
in the package changes). ``conveyor bench serve`` replays the workload from a second process, and py-spy samples
this process (both threads) meanwhile. Both sides stamp CLOCK_MONOTONIC, so the client's chunk arrivals are joined
with the engine's token times.

    python scripts/latency_account.py --workload WORKLOAD.json --request-rate 4 [--model DIR] [--dtype float32]
        [--py-spy .venv/bin/py-spy] [--out account.json]

Per step it records: the engine step (schedule, execute, update), output processing with detokenization apart,
the hand-off (snapshot + listeners on the engine thread, then the wait until the event loop runs the delivery),
the SSE encoding of that step's chunks, and per token the client-visible delay (client arrival - engine time).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from conveyor.engine.args import EngineArgs
from conveyor.engine.core_client import EngineCoreClient
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.engine.llm_engine import LLMEngine
from conveyor.server import serving_common
from conveyor.server.app import build_app
from conveyor.server.launcher import make_server


class Probe:
    """Per-step timestamps, written by wrappers on the engine thread and the event loop."""

    def __init__(self) -> None:
        self.steps: list[dict] = []  # one dict per engine step that produced outputs
        self.current: dict | None = None
        self.detok_s = 0.0
        self.sse_calls: list[tuple[float, float]] = []  # (end time, duration) of every SSE encoding
        self.token_times: dict[str, list[float]] = {}  # response id -> engine token times


def timed(store: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        t = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            store[key] = store.get(key, 0.0) + time.monotonic() - t
    return wrapper


def time_sse(probe: Probe) -> None:
    """Stamp the end and duration of every SSE encoding (``sse_events`` looks ``sse`` up at each call)."""
    sse = serving_common.sse

    def sse_wrapper(payload):
        t = time.monotonic()
        out = sse(payload)
        end = time.monotonic()
        probe.sse_calls.append((end, end - t))
        return out

    serving_common.sse = sse_wrapper


def instrument(engine: LLMEngine, app, probe: Probe) -> None:
    async_engine = app.state.async_engine
    phases: dict = {}
    engine.scheduler.schedule = timed(phases, "schedule", engine.scheduler.schedule)
    engine.executor.execute = timed(phases, "execute", engine.executor.execute)
    engine.scheduler.update = timed(phases, "update", engine.scheduler.update)
    engine.output_processor.process = timed(phases, "process", engine.output_processor.process)
    add_token = IncrementalDetokenizer.add_token

    def detok(self, token_id):
        t = time.monotonic()
        try:
            return add_token(self, token_id)
        finally:
            probe.detok_s += time.monotonic() - t

    IncrementalDetokenizer.add_token = detok  # this process only runs this measurement

    step = engine.step

    def step_wrapper():
        phases.clear()
        probe.detok_s = 0.0
        start = time.monotonic()
        outputs = step()
        end = time.monotonic()
        probe.current = {"start": start, "end": end, **phases, "detok": probe.detok_s, "num_outputs": len(outputs)}
        return outputs

    engine.step = step_wrapper
    engine.step_listeners.append(lambda r: phases.update(prefill=r.num_prefill_tokens, decode=r.num_decode_tokens))

    publish = async_engine._publish

    def publish_wrapper(outputs):
        t = time.monotonic()
        publish(outputs)
        cur = probe.current
        if cur is not None and cur["end"] <= t:
            cur["publish_start"], cur["published"] = t, time.monotonic()
            probe.steps.append(cur)
            probe.current = None
        for out in outputs:
            if out.finished:
                probe.token_times[out.request_id.rsplit("-", 1)[0]] = list(out.outputs[0].token_times)

    async_engine._publish = publish_wrapper
    async_engine._step_loop.publish = publish_wrapper  # the step loop holds the bound method it was given
    deliver = async_engine._deliver

    def deliver_wrapper(batch):
        t = time.monotonic()
        deliver(batch)
        if probe.steps and "delivered" not in probe.steps[-1]:
            probe.steps[-1]["delivered"], probe.steps[-1]["deliver_s"] = t, time.monotonic() - t

    async_engine._deliver = deliver_wrapper
    time_sse(probe)


def instrument_process(app, probe: Probe) -> None:
    """The engine in its own process: its step records (start, end of execute) come with each message; the
    server side stamps the loop's wake-up (the receiver thread's hand-off runs) and the end of output processing
    and delivery."""
    core = app.state.async_engine
    records: list = []
    core.step_listeners.append(records.append)
    handle = core._handle

    def handle_wrapper(message):
        t = probe.wake = time.monotonic()
        records.clear()
        handle(message)
        done = time.monotonic()
        if message.step is not None and message.step.outputs and records:
            last = records[-1]
            probe.steps.append({"start": last.start, "end": last.end, "wake": probe.wake, "received": t,
                                "delivered": t, "deliver_s": done - t, "prefill": last.num_prefill_tokens,
                                "decode": last.num_decode_tokens, "num_outputs": len(message.step.outputs)})

    core._handle = handle_wrapper
    core.output_listeners.append(lambda out: out.finished and probe.token_times.__setitem__(
        out.request_id.rsplit("-", 1)[0], list(out.outputs[0].token_times)))
    time_sse(probe)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def account(probe: Probe, client: dict) -> dict:
    """Per-step components (ms) for decode-only steps and steps with prefill, and the client-visible delay."""
    sse_ends = [e for e, _ in probe.sse_calls]
    rows: dict[str, dict[str, list[float]]] = {"decode-only": collections.defaultdict(list),
                                               "with prefill": collections.defaultdict(list)}
    steps = [s for s in probe.steps if "delivered" in s]
    for i, s in enumerate(steps):
        r = rows["with prefill" if s.get("prefill") else "decode-only"]
        r["# decode tokens in the step"].append(s.get("decode", 0))
        r["# prompt tokens in the step"].append(s.get("prefill", 0))
        if "wake" in s:  # the engine in its own process
            r["engine: schedule + execute (model)"].append(s["end"] - s["start"])
            r["engine: update, output processing, detok, send; pipe; loop wake-up"].append(s["wake"] - s["end"])
            r["server: receive + unpickle the step message"].append(s["received"] - s["wake"])
            r["server: decode deltas + deliver to streams"].append(s["deliver_s"])
        else:
            r["engine step: schedule"].append(s.get("schedule", 0))
            r["engine step: execute (model)"].append(s.get("execute", 0))
            r["engine step: update"].append(s.get("update", 0))
            r["output processing (w/o detok)"].append(s.get("process", 0) - s["detok"])
            r["detokenization"].append(s["detok"])
            r["step() total"].append(s["end"] - s["start"])
            r["hand-off: snapshot + listeners (engine thread)"].append(s["published"] - s["publish_start"])
            r["hand-off: wait for the event loop"].append(s["delivered"] - s["published"])
            r["hand-off: delivery on the loop"].append(s["deliver_s"])
        nxt = steps[i + 1]["delivered"] if i + 1 < len(steps) else float("inf")
        lo, hi = bisect.bisect_left(sse_ends, s["delivered"]), bisect.bisect_left(sse_ends, nxt)
        r["SSE encoding (json + framing), all chunks"].append(sum(d for _, d in probe.sse_calls[lo:hi]))
        if hi > lo:
            r["loop: delivery -> last chunk encoded"].append(sse_ends[hi - 1] - s["delivered"])
        if i + 1 < len(steps):
            r["step start -> next step start (token cadence)"].append(steps[i + 1]["start"] - s["start"])
            if "wake" not in s:
                r["engine thread outside step()"].append(steps[i + 1]["start"] - s["end"])
    delays, matched, total = [], 0, 0
    t0 = client["clock_t0"]
    for req in client["requests"]:
        server = probe.token_times.get(req.get("server_id"))
        total += 1
        if server is None or len(server) != len(req["token_times"]):
            continue  # chunks coalesced (a slow reader) or no match: no 1:1 token join
        matched += 1
        delays += [t0 + c - e for c, e in zip(req["token_times"], server)]
    def summary(name: str, v: list[float]) -> dict:
        k = 1.0 if name.startswith("#") else 1e3  # counts stay counts; times in ms
        return {"n": len(v), "mean": k * statistics.fmean(v), "p50": k * pct(v, 0.5), "p99": k * pct(v, 0.99)}

    out = {kind: {name: summary(name, v) for name, v in r.items() if v} for kind, r in rows.items()}
    out["client-visible delay (chunk arrival - engine token time)"] = {
        "requests joined 1:1": f"{matched}/{total}", "n": len(delays),
        **(summary("ms", delays) if delays else {})}
    out["client summary"] = client["summary"]
    return out


def py_spy_split(raw_path: str) -> dict:
    """py-spy's collapsed stacks -> per thread, the share of samples by what the thread was doing."""
    rules = [  # first match wins; matched against the whole stack, innermost first
        ("engine", [("execute", "model forward (executor.execute)"), ("schedule (", "schedule"),
                    ("update (conveyor/core", "scheduler.update"), ("add_token", "detokenization"),
                    ("process (conveyor/engine/output_processor", "output processing"),
                    ("_publish", "hand-off (snapshot)"), ("_write", "send (msgpack, socket)"),
                    ("make_stats", "stats snapshot"), ("_run_commands", "waiting for / running commands"),
                    ("step (", "step: other")]),
        ("loop", [("sse (", "SSE encoding"), ("dumps", "JSON"), ("_deliver", "delivery"),
                  ("_receive_forever", "receive step message"),
                  ("process (conveyor/engine/output_processor", "output processing"),
                  ("select (selectors", "idle (epoll)"), ("h11", "HTTP (h11)"),
                  ("serving_", "handlers"), ("starlette", "starlette/fastapi"), ("uvicorn", "uvicorn"),
                  ("asyncio", "asyncio")]),
    ]
    counts: dict[str, collections.Counter] = {"engine": collections.Counter(), "loop": collections.Counter(),
                                              "other": collections.Counter()}
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not n.isdigit():
                continue
            if "_run (conveyor/engine/async_engine.py" in stack or "run (conveyor/engine/step_loop.py" in stack:
                thread = "engine"
            elif "run (uvicorn" in stack or "serve (" in stack:
                thread = "loop"
            else:
                thread = "other"
            frames = stack.split(";")[::-1]
            label = "other"
            for name, table in rules:
                if name != thread:
                    continue
                label = next((lab for key, lab in table if any(key in fr for fr in frames)), "other")
            counts[thread][label] += int(n)
    return {t: {k: round(100.0 * v / max(1, sum(c.values())), 1) for k, v in c.most_common()}
            for t, c in counts.items() if c}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--request-rate", default="4")
    ap.add_argument("--warmup", type=int, default=20, help="requests sent first, not measured")
    ap.add_argument("--py-spy", default=None, help="path of the py-spy binary (sampling both threads)")
    ap.add_argument("--engine-process", action="store_true", help="the engine in its own process (the default "
                    "of conveyor serve); without: in a thread of the server (conveyor serve --engine-in-process)")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()

    args = EngineArgs(model=ns.model, dtype=ns.dtype)
    probe = Probe()
    if ns.engine_process:
        app = build_app(EngineCoreClient(args), ns.model, log_stats_interval_s=0.0)
        instrument_process(app, probe)
    else:
        engine = LLMEngine(args)
        app = build_app(engine, ns.model, log_stats_interval_s=0.0)
        instrument(engine, app, probe)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(app, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    bench = [sys.executable, "-m", "conveyor.cli", "bench", "serve", "--base-url", url, "--workload", ns.workload]
    subprocess.run(bench + ["--num-requests", str(ns.warmup), "--request-rate", "inf"], check=True,
                   stdout=subprocess.DEVNULL)
    probe.__init__()
    probe.wake = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        spy = None
        if ns.py_spy:
            spy = subprocess.Popen([ns.py_spy, "record", "--pid", str(os.getpid()), "--threads", "--idle",
                                    *(["--subprocesses"] if ns.engine_process else []),
                                    "--rate", "250", "--format", "raw", "--output", f"{tmp}/spy.txt"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        subprocess.run(bench + ["--request-rate", ns.request_rate, "--json", f"{tmp}/client.json"], check=True)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
        with open(f"{tmp}/client.json") as f:
            result = account(probe, json.load(f))
        if spy is not None and os.path.exists(f"{tmp}/spy.txt"):
            result["py-spy: % of samples per thread (idle included)"] = py_spy_split(f"{tmp}/spy.txt")
    server.should_exit = True
    thread.join(30)
    text = json.dumps(result, indent=1)
    print(text)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
