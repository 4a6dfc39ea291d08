#!/usr/bin/env python3
"""The eviction policies on the real engine, in one process: a fresh engine per run, the arms alternating.

    PYTHONPATH=. python benchmarks/prefix_eviction_ab.py --workload sp240.json --num-requests 60 \\
        --num-kv-blocks 96 --rounds 3 [--arms lru,cost | lru,lru-shuffled,cost]

The bench model (random weights) on the CPU, chunked policy, every request at t=0 (so the schedule does not
depend on timing and each arm's savings repeat exactly); per run: wall, CPU time (all threads), steps, saved
tokens, evictions, preemptions. ``lru-shuffled`` is LRU over a shuffled initial free list: where the blocks sit
in memory, without the policy. Arms run in reverse order on odd rounds.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace

import torch

from conveyor.bench.online import replay
from conveyor.bench.workload import Workload, load_workload
from conveyor.core.block_pool import FreeBlockList
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine
from conveyor.models import EMBEDDED_NAME


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True)
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--num-kv-blocks", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arms", default="lru,cost")
    ns = p.parse_args()
    torch.set_flush_denormal(True)  # as bench compare does (the random-weights model meets denormals)
    w = load_workload(ns.workload)
    w = Workload(w.name, w.requests[: ns.num_requests]).all_at_once()
    args = EngineArgs(model=EMBEDDED_NAME, policy="chunked", max_model_len=1024, num_kv_blocks=ns.num_kv_blocks,
                      detokenize=False)
    base = LLMEngine(args)
    replay(base, Workload("warmup", w.requests[:8]))
    arms = ns.arms.split(",")
    for k in range(ns.rounds):
        for arm in arms if k % 2 == 0 else arms[::-1]:
            e = LLMEngine.sharing_model(base, replace(args, prefix_cache_eviction=arm.split("-")[0]))
            if arm == "lru-shuffled":
                blocks = list(e.kv_manager.pool.blocks)
                random.Random(k).shuffle(blocks)
                e.kv_manager.pool.free_list = FreeBlockList(blocks)
            c0, t0 = time.process_time(), time.perf_counter()
            res = replay(e, w)
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            print(f"round {k} {arm:12s} wall {wall:6.1f} s  cpu {cpu:6.1f} s  steps {len(res.steps)}  saved "
                  f"{e.kv_manager.prefix_saved_tokens}  evictions {e.kv_manager.pool.num_evictions}  preempt "
                  f"{res.num_preemptions}", flush=True)


if __name__ == "__main__":
    main()
