#!/usr/bin/env python3
"""What an allocation costs under each prefix-cache eviction policy (``lru``, ``cost``), alternated in one run.

    python benchmarks/prefix_eviction.py [--sizes 1024,20480,200000] [--rounds 7] [--ops 20000]

Two loops per pool size, both at steady state with every free block cached, so every allocation evicts:

- ``pool``: ``BlockPool`` alone: allocate two blocks (two evictions), give them fresh keys as a request's first
  and second block (``cache_full_block``, the second chained to the first), free them tail first. The policy's
  whole per-block cost: LRU's list surgery against the heap push / pop and the child counts.
- ``kv``: ``KVCacheManager`` as the scheduler drives it: a request of 4 blocks (a 2-block prefix from one of 64
  shared ones, plus a unique 2-block suffix) looked up, allocated, freed; per block allocated, hashing included.

CPU time (``time.process_time``) per block, best of ``--rounds``, lru and cost taking turns; keys are computed
before the timed loop (``pool``), so the SHA-256 of a key (~0.7 us) is not in the ``pool`` numbers.
"""

from __future__ import annotations

import argparse
import random
import time

from conveyor.core import Request, SamplingParams
from conveyor.core.block_pool import BlockPool, hash_block
from conveyor.core.kv_manager import KVCacheManager


def pool_loop(policy: str, size: int, ops: int) -> float:
    pool = BlockPool(size, policy)
    keys = [hash_block(None, [i]) for i in range(size + ops + 1)]
    blocks = pool.allocate(size)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, keys[i], keys[i - 1] if i % 2 else None, i % 2)
    pool.free(reversed(blocks))
    t0 = time.process_time()
    for i in range(size, size + ops, 2):
        a, b = pool.allocate(2)
        pool.cache_full_block(a, keys[i], None, 0)
        pool.cache_full_block(b, keys[i + 1], keys[i], 1)
        pool.free((b, a))
    return (time.process_time() - t0) / ops


def kv_loop(policy: str, size: int, ops: int, rng: random.Random) -> float:
    bs = 16
    kv = KVCacheManager(size, bs, prefix_cache_eviction=policy)
    prefixes = [[rng.randrange(32000) for _ in range(2 * bs)] for _ in range(64)]
    prompts = [rng.choice(prefixes) + [rng.randrange(32000) for _ in range(2 * bs)] + [1] for _ in range(ops)]
    reqs = [Request(str(i), p, SamplingParams(max_tokens=1)) for i, p in enumerate(prompts)]
    for r in reqs[: size // 3]:  # fill the cache first: the timed loop runs with every allocation evicting
        _admit_free(kv, r)
    allocated = 0
    t0 = time.process_time()
    for r in reqs[size // 3:]:
        allocated += _admit_free(kv, r)
    return (time.process_time() - t0) / max(allocated, 1)


def _admit_free(kv: KVCacheManager, r: Request) -> int:
    hits, n = kv.get_computed_blocks(r)
    new = kv.allocate_slots(r, r.num_tokens - n, hits)
    kv.free(r)
    return len(new)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1024,20480,200000")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ops", type=int, default=20000)
    ns = p.parse_args()
    for size in (int(s) for s in ns.sizes.split(",")):
        best = {(loop, pol): float("inf") for loop in ("pool", "kv") for pol in ("lru", "cost")}
        for _ in range(ns.rounds):
            for pol in ("lru", "cost"):
                best["pool", pol] = min(best["pool", pol], pool_loop(pol, size, ns.ops))
                best["kv", pol] = min(best["kv", pol], kv_loop(pol, size, max(ns.ops // 4, size // 2),
                                                              random.Random(0)))
        for loop in ("pool", "kv"):
            lru, cost = best[loop, "lru"] * 1e9, best[loop, "cost"] * 1e9
            print(f"{size:>7} blocks  {loop:<4}  lru {lru:7.0f} ns/block  cost {cost:7.0f} ns/block  "
                  f"(+{cost - lru:.0f} ns, x{cost / lru:.2f})")


if __name__ == "__main__":
    main()
