#!/usr/bin/env python3
"""Soak test: thousands of mixed requests against ``conveyor serve`` with random client disconnects; checks that
nothing fails and nothing leaks.

    python scripts/soak.py --num-streams 2000 --disconnect-fraction 0.4 --json soak.json   # the embedded model
    python scripts/soak.py --model DIR --engine-in-process --uvicorn-loop asyncio --num-streams 200
    python scripts/soak.py --num-streams 200 -- --max-num-seqs 64 --dtype float32          # more serve flags

It starts ``conveyor serve`` itself on a free loopback port (default layout: the engine core in a process of its
own; ``--engine-in-process`` for the thread), so it can read the RSS of the server and its engine process and
the server's log, and stops it by PID at the end (checking no process of it is left). A warm-up of the same mix
(``--warmup`` requests, then more rounds until a round leaves the RSS flat) comes first, so that RSS growth is
measured from the working size of the allocators and of the KV pool (allocated untouched, written block by block
as the free list hands every block out in turn), not from an idle process. Then ``--num-streams`` requests, ``--concurrency`` clients at a time, the mix of
tests/helpers/load.py ``mixed_request``: /v1/completions 60% / chat 40%, temperature / top_p / top_k / min_p /
penalties / seed, n 1-3, logprobs 0-5, stop strings, ignore_eos, min_tokens, include_usage, max_tokens 1-48; all
streaming but a fraction ``--abandon`` of non-streaming requests abandoned by a 50 ms client timeout. A fraction
``--disconnect-fraction`` of the streams is closed by the client after 1-4 chunks. ``--time-cap-s`` bounds the
run: no request starts after it, those in flight get 180 s more.

It passes (exit 0) when:

- no request got an HTTP error (no queue bound is configured unless you pass one after ``--``), a client-side
  exception or an in-band error chunk;
- every stream read to the end ends with ``data: [DONE]`` and one finish_reason (stop / length) per choice;
- after the run the running / waiting / KV-usage gauges return to 0 (within 10 s), /health is 200 and an
  ordinary request is served;
- the RSS of the server + engine process grew by less than ``--max-rss-growth-mb`` (50) from after the warm-up
  to the end;
- the server log holds no traceback and no ERROR line, and no process of the server outlives it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.helpers.load: the drivers it shares

from tests.helpers.load import Tally, counter, gauges, idle, run_clients, start_serve, wait_gauges  # noqa: E402

DEFAULT_MODEL = "conveyor-embedded-llama-40m-random"
SERVED_NAME = "soak"


def run_phase(served, args, num: int, seed: int, progress: list | None = None):
    marks = {num * k // 10 for k in range(1, 11)}

    def on_progress(done: int) -> None:
        if progress is not None and done in marks:
            progress.append((done, served.rss_by_process()))

    return asyncio.run(run_clients(served.url, SERVED_NAME, clients=args.concurrency, num_requests=num,
                                   duration_s=args.time_cap_s, disconnect_fraction=args.disconnect_fraction,
                                   stream_fraction=1.0, abandon_fraction=args.abandon, seed=seed,
                                   on_progress=on_progress))


def warm_up(served, args):
    """``--warmup`` requests, then rounds of ``--warmup`` more while a round still grew the RSS by more than
    ``--warmup-flat-mb`` (at most ``--max-warmup`` requests in all). The KV pool is allocated untouched and the
    free list hands out every block in turn (freed blocks go to its tail), so the RSS climbs until each block
    has been written once (about 1 GB for the embedded model's 8,192 blocks at its defaults): growth that
    stops, which the measurement must not count as a leak. A leak never goes flat, and still shows."""
    tally = Tally()
    trace = [(0, served.rss_by_process())]
    sent = 0
    while True:
        size = min(args.warmup, args.max_warmup - sent)
        if size <= 0:
            break
        phase = run_phase(served, args, size, args.seed + 1 + sent)
        merge(tally, phase)
        sent += size
        wait_gauges(served.url, idle, 10.0)
        trace.append((sent, served.rss_by_process()))
        if sum(trace[-1][1].values()) - sum(trace[-2][1].values()) <= args.warmup_flat_mb or tally.server_gone:
            break
    return tally, trace


def merge(a, b):
    for name, value in vars(b).items():
        mine = getattr(a, name)
        if isinstance(value, dict):
            for k, v in value.items():
                mine[k] = mine.get(k, 0) + v
        elif isinstance(value, list):
            mine.extend(value)
        else:
            setattr(a, name, mine + value)
    return a


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="what `conveyor serve --model` takes")
    parser.add_argument("--engine-in-process", action="store_true", help="the engine in a thread of the server")
    parser.add_argument("--uvicorn-loop", default="auto", choices=["auto", "uvloop", "asyncio"])
    parser.add_argument("--num-streams", "--streams", dest="num_streams", type=int, default=2000,
                        help="requests to send after the warm-up")
    parser.add_argument("--disconnect-fraction", "--disconnect", dest="disconnect_fraction", type=float,
                        default=0.4, help="fraction of streams cut after 1-4 chunks")
    parser.add_argument("--abandon", type=float, default=0.03,
                        help="fraction of requests sent non-streaming and abandoned after 50 ms")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=200,
                        help="requests of the same mix before measuring, and the size of each further warm-up round")
    parser.add_argument("--warmup-flat-mb", type=float, default=10.0,
                        help="warm up until a round grows the RSS by at most this much")
    parser.add_argument("--max-warmup", type=int, default=4000, help="the most warm-up requests in all")
    parser.add_argument("--time-cap-s", type=float, default=3600.0,
                        help="no request starts after this many seconds of the main run (a bound, not a target)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--log", default=None, help="the server's log file (default: a new file in the temp dir)")
    parser.add_argument("serve_args", nargs="*", help="more flags for `conveyor serve` (after --)")
    args = parser.parse_args(argv)
    if "--model" in args.serve_args:  # the older spelling: the model among the serve flags
        i = args.serve_args.index("--model")
        args.model = args.serve_args[i + 1]
        del args.serve_args[i:i + 2]

    log_path = Path(args.log or tempfile.mkstemp(prefix="conveyor-soak-", suffix=".log")[1])
    result: dict = {"model": args.model, "engine_in_process": args.engine_in_process,
                    "uvicorn_loop": args.uvicorn_loop, "num_streams": args.num_streams,
                    "disconnect_fraction": args.disconnect_fraction, "abandon": args.abandon,
                    "concurrency": args.concurrency, "warmup": args.warmup, "seed": args.seed}
    started = time.monotonic()
    served = start_serve(args.model, log_path, in_process=args.engine_in_process, loop=args.uvicorn_loop,
                         extra=args.serve_args, served_model_name=SERVED_NAME)
    result["command"] = " ".join(served.cmd)
    result["startup_s"] = round(time.monotonic() - started, 1)
    survivors: list[str] = []
    try:
        result["rss_mb_idle"] = served.rss_by_process()
        warm, warm_rss = warm_up(served, args)
        result["rss_mb_warmup"] = warm_rss
        rss = [(0, served.rss_by_process())]
        aborts_before = counter(served.url, "conveyor:request_success_total", finished_reason="abort")
        start = time.monotonic()
        tally = run_phase(served, args, args.num_streams, args.seed, rss)
        result["wall_s"] = round(time.monotonic() - start, 1)
        result["time_cap_hit"] = tally.requests < args.num_streams
        first_poll = gauges(served.url)
        settled, last, trace = wait_gauges(served.url, idle, 10.0, poll_s=0.2)
        result["rss_mb"] = rss + [("end", served.rss_by_process())]
        first, last_rss = result["rss_mb"][0][1], result["rss_mb"][-1][1]
        result["rss_growth_mb_by_process"] = {k: round(last_rss[k] - first[k], 1) for k in first}
        result["rss_growth_mb"] = round(sum(last_rss.values()) - sum(first.values()), 1)
        health = httpx.get(served.url + "/health", timeout=10).status_code
        ordinary = httpx.post(served.url + "/v1/completions", timeout=60,
                              json={"model": SERVED_NAME, "prompt": "hello", "max_tokens": 4}).status_code
        result.update(warmup_tally=warm.summary(), tally=tally.summary(), gauges_first_poll=first_poll,
                      gauges_settled=last, gauges_settled_after_s=trace[-1][0] if settled else None,
                      health_after=health, ordinary_request_after=ordinary,
                      server_aborts=counter(served.url, "conveyor:request_success_total",
                                            finished_reason="abort") - aborts_before)
    except Exception as exc:  # noqa: BLE001 - a dead or wedged server is a result, reported below
        result["error"] = repr(exc)
    finally:
        result["server_exit"], survivors = served.stop(timeout_s=60)
    result["survivors"] = survivors
    log_text = log_path.read_text(errors="replace")
    noisy = [line for line in log_text.splitlines() if "Traceback" in line or line.startswith(("ERROR", "CRITICAL"))]
    result["log"] = str(log_path)
    result["log_error_lines"] = len(noisy)
    t, w = result.get("tally", {}), result.get("warmup_tally", {})
    both = (t, w) if t and w else ()
    checks = {
        "the run completed": "error" not in result and bool(both),
        "no HTTP errors": bool(both) and all(set(x["statuses"]) <= {"200"} for x in both),
        "no client exceptions": bool(both) and not any(x["client_exceptions"] for x in both),
        "no in-band errors": bool(both) and all(x["in_band_errors"] == 0 for x in both),
        "every completed stream ends with [DONE] and a finish_reason per choice":
            bool(both) and all(x["missing_done"] == x["bad_finish"] == 0 for x in both),
        "gauges back to 0": idle(result["gauges_settled"]) if "gauges_settled" in result else False,
        "healthy and serving after": result.get("health_after") == result.get("ordinary_request_after") == 200,
        f"RSS growth < {args.max_rss_growth_mb:g} MB": result.get("rss_growth_mb", 1e9) < args.max_rss_growth_mb,
        "no traceback or ERROR in the server log": not noisy,
        "no process of the server left": not survivors,
    }
    result["checks"] = checks
    result["passed"] = all(checks.values())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("checks", "passed", "warmup_tally")}))
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    for line in noisy[:10]:
        print("server log:", line, file=sys.stderr)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
