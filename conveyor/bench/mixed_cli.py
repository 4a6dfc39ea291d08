"""``conveyor bench mixed``: its command line, over HTTP (``mixed_http.py``) or on the simulator (``mixed_sim.py``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import asdict

from conveyor.bench.mixed import MODES, VLLM_LOW_PRIORITY, format_rows, make_traffic
from conveyor.bench.mixed_http import run_http
from conveyor.bench.mixed_sim import add_sim_args, run_simulated


def add_mixed_parser(sub) -> None:
    p = sub.add_parser("mixed", help="an interactive stream beside a batch job (Batch API, FCFS or low priority), "
                       "over HTTP or on the simulator: interactive latency, goodput, total output tokens/s")
    p.add_argument("--mode", action="append", choices=MODES, default=None,
                   help="run these modes, one after the other (repeat; default: all)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (not with --simulate)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="the model name to send (default: the server's first); with "
                   "--simulate, the simulator's model (e.g. llama-70b)")
    p.add_argument("--simulate", default=None, metavar="HARDWARE",
                   help="run on the simulator instead: a hardware name (H100, ...) or a calibration profile")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="with --simulate")
    p.add_argument("--interactive-requests", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=2.0, help="interactive requests per second (Poisson)")
    p.add_argument("--prompt-len", default="32,256", help="interactive prompt tokens: LO,HI (uniform)")
    p.add_argument("--output-len", default="32,128", help="interactive output tokens: LO,HI (uniform)")
    p.add_argument("--batch-requests", type=int, default=1000)
    p.add_argument("--batch-prompt-len", default="64,512")
    p.add_argument("--batch-output-len", default="64,256")
    p.add_argument("--batch-concurrency", type=int, default=64,
                   help="fcfs / low-priority / offline over HTTP: batch requests in flight at once")
    p.add_argument("--low-priority", type=int, default=VLLM_LOW_PRIORITY, help="the batch's priority in "
                   "low-priority mode (lower runs first; interactive requests have 0)")
    p.add_argument("--service-tier", default=None, help="service_tier of the interactive requests")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: the interactive TTFT target")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: the interactive TPOT target")
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids of the random prompts are below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--json", default=None, help="write every mode's result to this file")
    add_sim_args(p)
    p.set_defaults(func=run_mixed)


def run_mixed(ns: argparse.Namespace) -> int:
    traffic = make_traffic(ns)
    modes = ns.mode or list(MODES)
    results = []
    for mode in modes:
        print(f"[bench mixed] {mode} ...", file=sys.stderr)
        result = run_simulated(ns, traffic, mode) if ns.simulate else asyncio.run(run_http(ns, traffic, mode))
        results.append(result)
        print(format_rows([result]).splitlines()[-1], file=sys.stderr)
    where = f"simulated {ns.simulate}" if ns.simulate else ns.base_url
    print(f"bench mixed: {ns.interactive_requests} interactive at {ns.request_rate:g} req/s, a batch of "
          f"{ns.batch_requests}; {where}" + (f"; SLO {traffic.slo_ms}" if traffic.slo_ms else ""))
    print(format_rows(results))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(ns).items() if k not in ("func", "api_key")},
                       "results": [asdict(r) | {"output_throughput": r.output_throughput} for r in results]}, f,
                      indent=1)
    return 0 if all(math.isfinite(r.window_s) for r in results) else 1
