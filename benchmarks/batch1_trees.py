#!/usr/bin/env python3
"""Two (or more) checkouts of conveyor taking turns at one-request greedy decode on a GGUF, with ``llama-bench``
in every round: a change's batch-1 speed against the tree it came from, measured in one run.

    python benchmarks/batch1_trees.py --gguf PATH/model.gguf --tree main=/path/a --tree mine=/path/b \
        [--llama-bench PATH/llama-bench] [--rounds 8] [--threads 2]

Each tree runs in a process of its own (``PYTHONPATH`` = the tree: its Python and its native kernels), loads the
GGUF once (``LLM``, prefix caching off) and waits. Per round each tree in turn (the order alternating) decodes
256 greedy tokens after a fixed 64-token prompt; its rate is 255 tokens over the run's time less that of a
1-token run (the prefill), then ``llama-bench -p 0 -n 128 -r 1`` runs. Before the rounds the trees' greedy tokens
are compared. Printed: each round, each tree's median and range, the second tree over the first per round and
each tree over the same round's llama-bench. On a shared machine a round that another job disturbed shows as
all three rates low: read the rounds, not only the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import gguf_side_by_side as sbs  # noqa: E402

WORKER = r"""
import sys, time
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm import LLM

llm = LLM(sys.argv[1], num_threads=int(sys.argv[2]), enable_prefix_caching=False)
prompt = [(7 * j + 11) % 40000 + 100 for j in range(64)]

def run(n):
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    return out.outputs[0].token_ids, time.perf_counter() - t

run(256)
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "tokens":
        print("tokens", list(run(256)[0]), flush=True)
    else:
        first = run(1)[1]
        print("rate", 255 / (run(256)[1] - first), flush=True)
"""


def reply(proc: subprocess.Popen, tag: str) -> str:
    while True:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker exited before answering {tag!r}")
        if line.startswith(tag):
            return line[len(tag):].strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (none: no llama.cpp column)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ns = ap.parse_args(argv)
    procs = {}
    for spec in ns.tree:
        name, tree = spec.split("=", 1)
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), HF_HUB_OFFLINE="1")
        procs[name] = subprocess.Popen([sys.executable, "-c", WORKER, ns.gguf, str(ns.threads)], cwd=tree, env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for name, proc in procs.items():
        reply(proc, "ready")
    tokens = {}
    for name, proc in procs.items():
        proc.stdin.write("tokens\n")
        proc.stdin.flush()
        tokens[name] = reply(proc, "tokens")
    names = list(procs)
    print(f"greedy tokens equal across trees: {len(set(tokens.values())) == 1}", flush=True)
    rates = {n: [] for n in names + (["llama-bench"] if ns.llama_bench else [])}
    for r in range(ns.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            procs[name].stdin.write("go\n")
            procs[name].stdin.flush()
            rates[name].append(float(reply(procs[name], "rate")))
        if ns.llama_bench:
            rates["llama-bench"].append(sbs.run_llama_bench(ns.llama_bench, ns.gguf, ns.threads, 128, 1)["tg128"])
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()), flush=True)
    for n, v in rates.items():
        print(f"{n}: median {statistics.median(v):.1f} tok/s, range {min(v):.1f}-{max(v):.1f}")
    if len(names) >= 2:
        ratios = [b / a for a, b in zip(rates[names[0]], rates[names[1]])]
        print(f"{names[1]} / {names[0]} per round: median {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.3f}-{max(ratios):.3f}")
    if ns.llama_bench:
        for n in names:
            lr = [a / b for a, b in zip(rates[n], rates["llama-bench"])]
            print(f"{n} / llama-bench per round: median {statistics.median(lr):.3f}, range {min(lr):.3f}-{max(lr):.3f}")
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
