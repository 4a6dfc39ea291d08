"""Load and fault drivers against ``conveyor serve`` run as a user runs it: a subprocess on 127.0.0.1, stopped by
PID, with a check that none of its processes outlives it. Used by tests/server/test_load_faults.py and scripts/soak.py.

- ``start_serve``: the subprocess (engine process or ``--engine-in-process``, uvloop or asyncio),
  its log, its descendants (the engine core, multiprocessing's resource tracker), their RSS;
- ``SSEStream``: one streaming request read event by event (open, read until k chunks, close, read to the end),
  so a test can hold many streams past their first chunk and then act (close them all, SIGTERM, kill -9);
- ``mixed_request`` / ``run_clients``: concurrent clients sending a random mix of completions and chat,
  streaming and not, over the sampling parameters a real client uses; every outcome lands in a ``Tally``;
- ``gauges`` / ``wait_gauges``: the running / waiting / KV gauges from /metrics;
- ``SharedServer``: one server per (layout, loop) handed to each test healthy and idle (``assert_serving``).

Nothing here imports conveyor, so a script can drive a server of any checkout.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil  # in the test extra
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.load_protocols import PROTOCOL_PATHS, as_protocol, finishes_of, read_line

RUNNING = "conveyor:num_requests_running"
WAITING = "conveyor:num_requests_waiting"
KV_USAGE = "conveyor:kv_cache_usage_perc"
GAUGES = (RUNNING, WAITING, KV_USAGE)
FINISH_REASONS = {"stop", "length"}  # what a request that ran to its end may say (abort is for cut ones)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the server subprocess ---------------------------------------------------------------------------------
class Served:
    """A running ``conveyor serve``: ``proc``, ``url``, ``log_path``. It remembers every descendant it has seen
    (by pid and start time, so a reused pid is not mistaken for one), because once the server is gone its
    orphans are no longer its children."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, cmd: list[str]) -> None:
        self.proc, self.url, self.log_path, self.cmd = proc, url, log_path, cmd
        self._seen: dict[tuple[int, float], str] = {}
        self.exited_at: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def watch_exit(self) -> None:
        """From now on, note when the process exits (``exited_at``, time.monotonic()), in a thread."""
        self.exited_at: float | None = None

        def wait() -> None:
            self.proc.wait()
            self.exited_at = time.monotonic()

        threading.Thread(target=wait, daemon=True).start()

    def wait_exit(self, since: float, timeout_s: float) -> float | None:
        """After ``watch_exit``: seconds from ``since`` to the exit, waiting until ``since + timeout_s`` at most
        (None: still running then)."""
        while self.exited_at is None and time.monotonic() < since + timeout_s:
            time.sleep(0.02)
        return None if self.exited_at is None else self.exited_at - since

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def descendants(self) -> list[psutil.Process]:
        """The server's live descendants now (and remember them)."""
        try:
            found = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in found:
            try:
                self._seen[(p.pid, p.create_time())] = " ".join(p.cmdline())[:120]
            except psutil.Error:
                pass
        return found

    def engine_process(self) -> psutil.Process:
        """The engine core: the process the server's log names, else the child started by multiprocessing's spawn
        (not its resource tracker; the grammar-check workers start only with the first constrained request)."""
        match = re.search(r"engine in process (\d+)", self.log())
        if match:
            return psutil.Process(int(match.group(1)))
        for p in self.descendants():
            try:
                cmdline = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "multiprocessing.spawn" in cmdline or "multiprocessing-fork" in cmdline:
                return p
        raise AssertionError("no engine core process among the server's children:\n" + self.log()[-3000:])

    def rss_mb(self) -> float:
        """RSS of the server and all its descendants, MB."""
        return sum(self.rss_by_process().values())

    def rss_by_process(self) -> dict[str, float]:
        """RSS in MB of the server (the API process), of the engine core process (absent with
        --engine-in-process) and of the other descendants together (the resource tracker, grammar-check workers)."""
        out = {"server": 0.0, "engine": 0.0, "other": 0.0}
        match = re.search(r"engine in process (\d+)", self.log())
        engine_pid = int(match.group(1)) if match else None
        for p in [psutil.Process(self.pid), *self.descendants()]:
            try:
                key = "server" if p.pid == self.pid else "engine" if p.pid == engine_pid else "other"
                out[key] += p.memory_info().rss / 2**20
            except psutil.Error:
                pass
        return {k: round(v, 1) for k, v in out.items()}

    def survivors(self, wait_s: float = 10.0) -> list[str]:
        """Descendants ever seen that are still alive after up to ``wait_s``; each is killed (by pid)."""
        deadline = time.monotonic() + wait_s
        while True:
            left = []
            for (pid, started), cmdline in self._seen.items():
                try:
                    p = psutil.Process(pid)
                    if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                        left.append((p, cmdline))
                except psutil.NoSuchProcess:
                    pass
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for p, _ in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        return [f"{p.pid}: {cmdline}" for p, cmdline in left]

    def stop(self, timeout_s: float = 60.0) -> tuple[int, list[str]]:
        """SIGTERM (SIGKILL after ``timeout_s``); returns (exit status, surviving descendants)."""
        self.descendants()
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode, self.survivors()


def serve_command(model: str, *, in_process: bool = False, loop: str = "auto", extra: tuple | list = (),
                  served_model_name: str = "tiny") -> list[str]:
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", model, "--served-model-name", served_model_name,
           "--uvicorn-loop", loop]
    if in_process:
        cmd.append("--engine-in-process")
    return [*cmd, *map(str, extra)]


def start_serve(model: str, log_path: Path, *, in_process: bool = False, loop: str = "auto",
                extra: tuple | list = (), served_model_name: str = "tiny", startup_timeout_s: float = 300.0,
                env: dict | None = None) -> Served:
    """Start ``conveyor serve`` on a free loopback port and wait for /health 200. The startup bound is a bound,
    not a speed: under a load average of 25 a start has taken over 90 s."""
    return start_command(serve_command(model, in_process=in_process, loop=loop, extra=extra,
                                       served_model_name=served_model_name), log_path, startup_timeout_s, env)


def start_command(cmd: list[str], log_path: Path, startup_timeout_s: float = 300.0, env: dict | None = None) -> Served:
    """Start a ``conveyor serve`` command line (``cmd``, without host and port) on a free loopback port and wait for
    /health 200."""
    port = free_port()
    cmd = [*cmd, "--host", "127.0.0.1", "--port", str(port)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    log.close()
    served = Served(proc, f"http://127.0.0.1:{port}", log_path, cmd)
    deadline = time.monotonic() + startup_timeout_s
    try:
        while True:
            if not served.alive():
                raise RuntimeError(f"conveyor serve exited with {proc.returncode} at startup:\n{served.log()[-3000:]}")
            try:
                if httpx.get(served.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"conveyor serve not healthy after {startup_timeout_s:.0f} s")
            time.sleep(0.2)
        served.descendants()
        return served
    except BaseException:
        served.stop(timeout_s=10)
        raise


ANSWER_S = 10.0  # "the next ordinary request is answered within a few seconds": a wedge never answers


def tail(served: Served, chars: int = 3000) -> str:
    return "\n--- server log (tail) ---\n" + served.log()[-chars:]


def assert_serving(served: Served, model: str = "tiny", with_log: bool = True) -> None:
    """Alive, /health 200, and an ordinary request answered 200 within ANSWER_S."""
    log = (lambda: tail(served)) if with_log else (lambda: "")
    assert served.alive(), f"the server exited with status {served.proc.returncode}" + log()
    try:
        health = httpx.get(served.url + "/health", timeout=ANSWER_S).status_code
        ordinary = httpx.post(served.url + "/v1/completions", timeout=ANSWER_S,
                              json={"model": model, "prompt": "w5 w6", "max_tokens": 4}).status_code
    except httpx.HTTPError as exc:
        raise AssertionError(f"the server does not answer within {ANSWER_S:.0f} s: {exc!r}" + log()) from None
    assert (health, ordinary) == (200, 200), f"/health {health}, ordinary request {ordinary}" + log()


class SharedServer:
    """One ``conveyor serve`` per (layout, loop) for the cases that leave it running. ``get()`` hands it out
    healthy and idle; a server a previous case killed, wedged or left busy is stopped and a fresh one started,
    so one failure does not cascade into the next case. ``starts`` counts the servers started."""

    def __init__(self, model_dir, log_dir: Path, layout: str, loop: str, flags: tuple = (),
                 model: str = "tiny") -> None:
        self.model_dir, self.log_dir, self.layout, self.loop = model_dir, log_dir, layout, loop
        self.flags, self.model = flags, model
        self.served: Served | None = None
        self.starts = 0

    def get(self) -> Served:
        if self.served is not None:
            why = self._unfit()
            if why:
                print(f"restarting the shared server ({self.layout}, {self.loop}): {why}")
                self.close()
        if self.served is None:
            self.starts += 1
            self.served = start_serve(str(self.model_dir), self.log_dir / f"serve-{self.starts}.log",
                                      in_process=self.layout == "in-process", loop=self.loop, extra=self.flags,
                                      served_model_name=self.model)
        return self.served

    def _unfit(self) -> str | None:
        if not self.served.alive():
            return f"it exited with status {self.served.proc.returncode}"
        try:  # /health and the gauges are not enough: a wedged pipe (D-2) kept both looking fine
            assert_serving(self.served, self.model, with_log=False)
            settled, last, _ = wait_gauges(self.served.url, idle, 10.0, poll_s=0.2)
        except (AssertionError, httpx.HTTPError) as exc:
            return str(exc)[:300]
        return None if settled else f"it is still busy: {last}"

    def close(self) -> None:
        if self.served is not None:
            served, self.served = self.served, None
            _, left = served.stop(timeout_s=30)
            assert not left, f"processes outlived conveyor serve: {left}"


# httpx's own keep-alive expiry (5 s), as users' clients have it. The server keeps an idle connection for
# --timeout-keep-alive (65 s by default), so a pooled connection is never reused just as the server closes it
# (with the server at 5 s too, one request in ~1,300 of a load run was sent on a closing connection and failed
# with ReadError before any answer; these clients retry nothing, so that every failure counts).
KEEPALIVE_EXPIRY_S = 5.0


def client_limits(connections: int) -> httpx.Limits:
    return httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                        keepalive_expiry=KEEPALIVE_EXPIRY_S)


# ---- metrics -----------------------------------------------------------------------------------------------
def parse_gauges(text: str) -> dict[str, float]:
    values = dict.fromkeys(GAUGES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in GAUGES:
                values[sample.name] += sample.value
    return values


def gauges(url: str, timeout: float = 10.0) -> dict[str, float]:
    return parse_gauges(httpx.get(url + "/metrics", timeout=timeout).text)


def counter(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_gauges(url: str, until: Callable[[dict[str, float]], bool], timeout_s: float,
                poll_s: float = 0.05) -> tuple[bool, dict[str, float], list[tuple[float, dict]]]:
    """Poll /metrics until ``until(gauges)`` or ``timeout_s``; returns (met, last gauges, (t, gauges) trace)."""
    start = time.monotonic()
    trace = []
    while True:
        values = gauges(url)
        trace.append((round(time.monotonic() - start, 2), values))
        if until(values):
            return True, values, trace
        if time.monotonic() - start > timeout_s:
            return False, values, trace
        time.sleep(poll_s)


def idle(values: dict[str, float]) -> bool:
    return all(values[g] == 0.0 for g in GAUGES)


async def async_gauges(client: httpx.AsyncClient) -> dict[str, float]:
    return parse_gauges((await client.get("/metrics", timeout=10)).text)


# ---- one streaming request ---------------------------------------------------------------------------------
class SSEStream:
    """A streaming request read event by event. ``events`` holds the JSON chunks (in-band errors go to
    ``errors``), ``done`` whether ``data: [DONE]`` came, ``finishes`` the finish_reason per choice index.
    ``eof`` is set when the body ended (with or without [DONE]); ``exception`` names a client-side failure."""

    def __init__(self, client: httpx.AsyncClient, path: str, body: dict) -> None:
        self.client, self.path, self.body = client, path, {**body, "stream": True}
        self.status: int | None = None
        self.error_body: str | None = None
        self.events: list[dict] = []
        self.errors: list[dict] = []
        self.finishes: dict[int, str | None] = {}
        self.usage: dict | None = None
        self.done = self.eof = False
        self.exception: str | None = None
        self._resp: httpx.Response | None = None
        self._lines = None

    async def open(self) -> SSEStream:
        request = self.client.build_request("POST", self.path, json=self.body)
        try:
            self._resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            self.exception, self.eof = repr(exc), True
            return self
        self.status = self._resp.status_code
        if self.status != 200:
            self.error_body = (await self._resp.aread()).decode(errors="replace")
            await self._resp.aclose()
            self.eof = True
        else:
            self._lines = self._resp.aiter_lines()
        return self

    async def next_event(self) -> bool:
        """Read up to the next event (a data line; an NDJSON line for Ollama's routes); False at the end of the
        stream. Each protocol's lines are read by ``load_protocols.read_line``; its end (``[DONE]``,
        ``message_stop``, ``response.completed``, ``"done": true``) sets ``done``."""
        if self.eof:
            return False
        try:
            async for raw in self._lines:
                line = read_line(self.path, raw)
                if line is None:
                    continue
                if line.error is not None:
                    self.errors.append(line.error)
                self.done = self.done or line.done
                if line.event is None:
                    continue  # [DONE]: the body must end right after it
                self.events.append(line.event)
                self.finishes.update(line.finishes)
                if line.completion_tokens is not None:
                    self.usage = {"completion_tokens": line.completion_tokens}
                return True
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            self.exception = repr(exc)
        self.eof = True
        await self._resp.aclose()
        return False

    async def until_chunks(self, k: int) -> bool:
        """Read until ``k`` content chunks have come (False if the stream ended first)."""
        while len(self.events) < k:
            if not await self.next_event():
                return False
        return True

    async def read_to_end(self) -> SSEStream:
        while await self.next_event():
            pass
        return self

    async def close(self) -> None:
        """Hang up mid-stream (the connection is closed, not returned to the pool)."""
        if self._resp is not None and not self.eof:
            self.eof = True
            await self._resp.aclose()

    def complete(self, n: int, reasons: set[str] = FINISH_REASONS) -> bool:
        """Ended well: 200, no in-band error, every one of ``n`` choices has a finish_reason in ``reasons``,
        ``data: [DONE]``."""
        return (self.status == 200 and not self.errors and self.exception is None and self.done
                and sorted(self.finishes) == list(range(n)) and set(self.finishes.values()) <= reasons)

    def describe(self) -> str:
        return (f"status={self.status} chunks={len(self.events)} finishes={self.finishes} done={self.done} "
                f"errors={self.errors[:1]} exception={self.exception} body={(self.error_body or '')[:200]}")


async def open_streams(client: httpx.AsyncClient, path: str, bodies: list[dict], first_chunks: int = 1,
                       timeout_s: float = 60.0) -> list[SSEStream]:
    """Open one stream per body and read each until ``first_chunks`` chunks arrived (all of them, or raise)."""
    async def one(body):
        stream = await SSEStream(client, path, body).open()
        await stream.until_chunks(first_chunks)
        return stream

    streams = await asyncio.wait_for(asyncio.gather(*(one(b) for b in bodies)), timeout_s)
    short = [s.describe() for s in streams if len(s.events) < first_chunks]
    assert not short, f"{len(short)} of {len(streams)} streams ended before chunk {first_chunks}: {short[:3]}"
    return list(streams)


# ---- the mixed load ----------------------------------------------------------------------------------------
WORDS = ["w5", "w17", "w42", "w99", "w123", "w200", "w301", "w377", "conveyor", "batch", "token", "cache",
         "stream", "river", "stone", "light", "paper", "garden", "orange", "engine", "quiet", "the", "a", "of"]
STOPS = ["w7", "w42", "w1 w2", "\n", "e", "the", "."]


def mixed_request(rng: random.Random, model: str, stream_fraction: float = 0.7,
                  protocol_fraction: float = 0.3) -> tuple[str, dict, int]:
    """(path, body, number of choices) of a random request over what clients send: completions 60% / chat
    40%, streaming (``stream_fraction`` of them, with include_usage half the time) or not, temperature / top_p /
    top_k / min_p / presence / frequency / repetition penalties / seed, n 1-3, logprobs 0-5, stop strings,
    ignore_eos, min_tokens, max_tokens 1-48. A fraction ``protocol_fraction`` of the chat requests is sent in
    another protocol's shape instead (Anthropic Messages, Responses, Ollama chat and generate: one choice each,
    the fields each protocol has; ``load_protocols.as_protocol``)."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    body: dict = {"model": model, "max_tokens": rng.randint(1, 48), "n": rng.choice([1, 1, 1, 2, 3])}
    if rng.random() < 0.7:
        body["temperature"] = rng.choice([0.0, 0.5, 0.8, 1.0, 1.3])
    if rng.random() < 0.4:
        body["top_p"] = rng.choice([0.1, 0.5, 0.9, 1.0])
    if rng.random() < 0.3:
        body["top_k"] = rng.choice([-1, 1, 5, 50, 5000])
    if rng.random() < 0.2:
        body["min_p"] = rng.choice([0.0, 0.05, 0.2])
    if rng.random() < 0.3:
        body["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.3:
        body["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.2:
        body["repetition_penalty"] = rng.choice([0.8, 1.0, 1.2, 2.0])
    if rng.random() < 0.3:
        body["seed"] = rng.choice([0, 7, 12345, 2**32, 2**63 - 1])
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body["min_tokens"] = rng.randint(0, body["max_tokens"])
    if rng.random() < stream_fraction:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    logprobs = rng.choice([None, None, 0, 1, 3, 5])
    if rng.random() < 0.6:
        body["prompt"] = prompt
        if logprobs is not None:
            body["logprobs"] = logprobs
        return "/v1/completions", body, body["n"]
    body["messages"] = [{"role": "user", "content": prompt}]
    if rng.random() < protocol_fraction:
        path = rng.choice(PROTOCOL_PATHS)
        return path, as_protocol(path, body), 1
    if logprobs is not None:
        body["logprobs"], body["top_logprobs"] = True, logprobs
    return "/v1/chat/completions", body, body["n"]


@dataclass
class Tally:
    """Outcomes of a load run. ``failures`` keeps the first few failed requests, described."""

    requests: int = 0
    completed_streams: int = 0
    disconnected_streams: int = 0
    completed_non_streaming: int = 0
    abandoned_non_streaming: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    client_exceptions: dict[str, int] = field(default_factory=dict)
    in_band_errors: int = 0
    missing_done: int = 0
    bad_finish: int = 0
    completion_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def count(self, bucket: dict[str, int], key: str) -> None:
        bucket[key] = bucket.get(key, 0) + 1

    @property
    def server_gone(self) -> bool:
        """A connection was refused: the server is not there any more (the clients stop)."""
        return "ConnectError" in self.client_exceptions

    def fail(self, what: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(what[:400])

    @property
    def server_errors(self) -> int:
        return sum(v for k, v in self.statuses.items() if k.startswith("5"))

    def summary(self) -> dict:
        lat = sorted(self.latencies_s)
        pct = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 2)) if lat else (lambda q: None)
        return {"requests": self.requests, "completed_streams": self.completed_streams,
                "disconnected_streams": self.disconnected_streams,
                "completed_non_streaming": self.completed_non_streaming,
                "abandoned_non_streaming": self.abandoned_non_streaming, "statuses": self.statuses,
                "server_errors": self.server_errors, "client_exceptions": self.client_exceptions,
                "in_band_errors": self.in_band_errors, "missing_done": self.missing_done,
                "bad_finish": self.bad_finish, "completion_tokens": self.completion_tokens,
                "latency_s": {"p50": pct(0.5), "p99": pct(0.99), "max": lat[-1] if lat else None},
                "failures": self.failures}


async def one_request(client: httpx.AsyncClient, path: str, body: dict, n: int, tally: Tally,
                      cut_after: int | None = None, openai_client=None, abandon_after_s: float | None = None) -> None:
    """Send one request and tally how it ended. ``cut_after``: hang up a stream after that many chunks.
    ``openai_client``: send a non-streaming completion through the official client instead of httpx.
    ``abandon_after_s``: a non-streaming request whose client gives up after that long (if not answered)."""
    tally.requests += 1
    start = time.monotonic()
    if abandon_after_s is not None and not body.get("stream"):
        try:
            resp = await client.post(path, json=body, timeout=httpx.Timeout(30.0, read=abandon_after_s))
            tally.count(tally.statuses, str(resp.status_code))
            if resp.status_code == 200:
                tally.completed_non_streaming += 1
            else:
                tally.fail(f"{path} {json.dumps(body)[:200]} -> {resp.status_code} {resp.text[:200]}")
        except httpx.ReadTimeout:
            tally.abandoned_non_streaming += 1
        except httpx.HTTPError as exc:
            tally.count(tally.client_exceptions, type(exc).__name__)
            tally.fail(f"{path} {type(exc).__name__}: {exc}")
        return
    if body.get("stream"):
        stream = await SSEStream(client, path, body).open()
        if cut_after is not None:
            if await stream.until_chunks(cut_after) and not stream.eof:
                await stream.close()
                tally.disconnected_streams += 1
                tally.count(tally.statuses, str(stream.status))
                return
        await stream.read_to_end()
        tally.latencies_s.append(time.monotonic() - start)
        if stream.exception is not None:
            tally.count(tally.client_exceptions, stream.exception.split("(")[0])
            tally.fail(f"{path} {stream.describe()}")
            return
        tally.count(tally.statuses, str(stream.status))
        if stream.status != 200:
            tally.fail(f"{path} {stream.describe()}")
            return
        tally.in_band_errors += bool(stream.errors)
        tally.missing_done += not stream.done
        ok = stream.complete(n)
        tally.bad_finish += not ok and not stream.errors and stream.done
        if ok:
            tally.completed_streams += 1
            if stream.usage:
                tally.completion_tokens += stream.usage["completion_tokens"]
        else:
            tally.fail(f"{path} {json.dumps(body)[:200]} -> {stream.describe()}")
        return
    try:
        if openai_client is not None and path == "/v1/completions":
            choices, usage = await _openai_completion(openai_client, body)
            status = 200
        else:
            resp = await client.post(path, json=body)
            status = resp.status_code
            if status == 200:
                finishes, tokens = finishes_of(path, resp.json())
                choices, usage = [{"index": i, "finish_reason": r} for i, r in finishes], {
                    "completion_tokens": tokens}
    except Exception as exc:  # noqa: BLE001 - every client-side failure is an outcome to count
        status = getattr(exc, "status_code", None)
        if status is None:
            tally.count(tally.client_exceptions, type(exc).__name__)
            tally.fail(f"{path} {type(exc).__name__}: {exc}")
            return
        choices = None
    tally.latencies_s.append(time.monotonic() - start)
    tally.count(tally.statuses, str(status))
    if status != 200:
        tally.fail(f"{path} {json.dumps(body)[:200]} -> {status}")
        return
    reasons = sorted((c["index"], c["finish_reason"]) for c in choices)
    if [i for i, _ in reasons] != list(range(n)) or not {r for _, r in reasons} <= FINISH_REASONS:
        tally.bad_finish += 1
        tally.fail(f"{path} non-streaming finishes {reasons}")
        return
    tally.completed_non_streaming += 1
    tally.completion_tokens += (usage or {}).get("completion_tokens", 0)


async def _openai_completion(openai_client, body: dict):
    known = {"model", "prompt", "max_tokens", "n", "temperature", "top_p", "presence_penalty",
             "frequency_penalty", "seed", "stop", "logprobs"}
    kwargs = {k: v for k, v in body.items() if k in known}
    extra = {k: v for k, v in body.items() if k not in known}
    out = await openai_client.completions.create(**kwargs, extra_body=extra or None)
    return [c.model_dump() for c in out.choices], out.usage.model_dump() if out.usage else None


async def run_clients(url: str, model: str, *, clients: int, duration_s: float | None = None,
                      num_requests: int | None = None, disconnect_fraction: float = 0.0, seed: int = 0,
                      stream_fraction: float = 0.7, abandon_fraction: float = 0.0, openai_fraction: float = 0.0,
                      request_timeout_s: float = 120.0, drain_timeout_s: float = 180.0,
                      on_progress: Callable[[int], None] | None = None) -> Tally:
    """``clients`` concurrent clients, each sending one request after another (``mixed_request``) until
    ``duration_s`` has passed or ``num_requests`` have been sent in all (whichever comes first). A fraction
    ``disconnect_fraction`` of the streams hangs up after 1-4 chunks; a fraction ``abandon_fraction`` of all
    requests is sent non-streaming and abandoned by a 50 ms client timeout; a fraction ``openai_fraction`` of
    the other non-streaming completions goes through the official ``openai`` client. ``on_progress`` is called
    with the number of requests finished so far. Bounded: requests in flight when the time is up get
    ``drain_timeout_s`` more, then are cancelled and counted as client exceptions; a refused connection (the
    server is gone) stops every client."""
    assert duration_s is not None or num_requests is not None
    rng = random.Random(seed)
    tally = Tally()
    limits = client_limits(clients + 8)
    timeout = httpx.Timeout(request_timeout_s, connect=30.0)
    stop_at = time.monotonic() + duration_s if duration_s is not None else float("inf")
    budget = iter(range(num_requests)) if num_requests is not None else itertools.count()
    finished = itertools.count(1)
    openai_client = None
    if openai_fraction > 0:
        import openai

        openai_client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                           timeout=request_timeout_s,
                                           http_client=httpx.AsyncClient(limits=client_limits(clients + 8)))
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        async def worker(wrng: random.Random) -> None:
            for _ in budget:
                if time.monotonic() >= stop_at or tally.server_gone:
                    return
                abandon = wrng.random() < abandon_fraction
                path, body, n = mixed_request(wrng, model, 0.0 if abandon else stream_fraction)
                cut = wrng.randint(1, 4) if body.get("stream") and wrng.random() < disconnect_fraction else None
                via = openai_client if openai_client and wrng.random() < openai_fraction else None
                await one_request(client, path, body, n, tally, cut_after=cut, openai_client=via,
                                  abandon_after_s=0.05 if abandon else None)
                if on_progress is not None:
                    on_progress(next(finished))

        tasks = [asyncio.ensure_future(worker(random.Random(rng.random()))) for _ in range(clients)]
        cap = (duration_s or 0) + drain_timeout_s if duration_s is not None else None
        done, pending = await asyncio.wait(tasks, timeout=cap)
        for task in pending:
            task.cancel()
            tally.count(tally.client_exceptions, "unfinished at the time cap")
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                tally.count(tally.client_exceptions, type(task.exception()).__name__)
                tally.fail(f"client loop raised {task.exception()!r}")
    if openai_client is not None:
        await openai_client.close()
    return tally
