#!/usr/bin/env python3
"""Decode attention alone: the native kernel over a step of one-token requests, every layer's cache its own.

    python benchmarks/decode_attention.py [--dtype bfloat16] [--heads 9 --kv-heads 3 --head-dim 64]
        [--layers 30] [--shapes 86x190,86x500,16x500] [--rounds 10] [--key-mass] [--kv-int8] [--kv-bf16]

For each requests x keys shape: one attention call per layer (rope + KV write + attention, as the engine makes
them), over --layers separate caches so they come from DRAM as a real step's do (the defaults are SmolLM2-135M's
heads and layers); prints the best of --rounds in ms per step. To compare two versions of the kernels, run it on
each commit (the script works with the API before and after the per-step plan), alternated, on an idle machine:
the results in docs/kernels.md were measured this way or with both builds in one process.

--key-mass times each step twice, taking turns: as above, and with every request scored for KV eviction (the
kernel adds each query head's attention probabilities into a per-request buffer, as h2o asks of every decode
it scores), and prints what scoring adds (docs/kv-eviction.md).

--kv-int8 times each step twice, taking turns: over the --dtype cache, and over an int8 cache of the same K/V
(``--kv-cache-dtype int8``: D int8 values and a float32 scale per token and head), and prints the ratio, of the
wall time and of the process's CPU time (all threads; on a machine shared with other work the CPU time moves
less with their load) (docs/kv-cache.md).

--kv-bf16 (with --dtype float32) does the same with a bfloat16 copy of the cache under the float32 step
(``--kv-cache-dtype bfloat16``: half the bytes read, every row widened as it is read).
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--shapes", default="86x190,86x500,16x500", help="requests x keys, comma-separated")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--key-mass", action="store_true", help="also time the step with every request scored")
    ap.add_argument("--kv-int8", action="store_true", help="also time the step over an int8 KV cache")
    ap.add_argument("--kv-bf16", action="store_true", help="also time a float32 step over a bfloat16 KV cache")
    ap.add_argument("--queries", type=int, default=1,
                    help="query tokens per request (a step verifying k speculative tokens has 1 + k)")
    ns = ap.parse_args()

    import torch

    from conveyor.kernels import load_cpu_kernels

    if ns.threads:
        torch.set_num_threads(ns.threads)
    kernels = load_cpu_kernels()
    dtype = getattr(torch, ns.dtype)
    if kernels is None or not kernels.supports(dtype, ns.head_dim):
        print("no native attention for this dtype / head size on this CPU: nothing to measure")
        return 1
    h, kvh, d, bs = ns.heads, ns.kv_heads, ns.head_dim, ns.block_size
    print(f"{ns.dtype}, {h}/{kvh} heads x {d}, {ns.layers} layers, {torch.get_num_threads()} threads, "
          f"kernels {kernels.level}")
    for shape in ns.shapes.split(","):
        reqs, keys = (int(v) for v in shape.split("x"))
        nq = ns.queries
        blocks_per_req = -(-(keys + nq) // bs)
        num_blocks = reqs * blocks_per_req
        ids = list(range(num_blocks))
        random.Random(0).shuffle(ids)  # blocks scattered over the pool, as a long-running engine leaves them
        table = torch.tensor(ids, dtype=torch.int64).view(reqs, blocks_per_req)
        caches = [torch.randn(2, num_blocks, kvh, bs, d).to(dtype) for _ in range(ns.layers)]
        qsl = torch.arange(reqs + 1, dtype=torch.int64) * nq
        seq_lens = torch.full((reqs,), keys + nq, dtype=torch.int64)
        cos_sin = torch.randn(keys + nq + 1, d)
        qkv = torch.randn(reqs * nq, (h + 2 * kvh) * d).to(dtype)
        out = torch.empty(reqs * nq, h, d, dtype=dtype)
        q = qkv[:, :h * d].unflatten(1, (h, d))
        k = qkv[:, h * d:(h + kvh) * d].unflatten(1, (kvh, d))
        v = qkv[:, (h + kvh) * d:].unflatten(1, (kvh, d))
        variants = [{}]
        other_caches = []  # (name, the layers' caches) timed against the step's own
        if ns.kv_int8:
            from conveyor.layers.attention.kv_quant import quantize_rows

            other_caches.append(("int8 cache", [quantize_rows(c) for c in caches]))
        if ns.kv_bf16:
            if dtype != torch.float32:
                ap.error("--kv-bf16 times a float32 step over a bfloat16 cache: use --dtype float32")
            other_caches.append(("bfloat16 cache", [c.to(torch.bfloat16) for c in caches]))
        variants += [{"caches": c} for _, c in other_caches]
        if ns.key_mass:
            from conveyor.kernels.cpu_ops import KeyMass

            stride = -(-(keys + 1) // 32) * 32
            variants.append({"key_mass": KeyMass(torch.zeros(reqs, kvh, stride), torch.ones(reqs, dtype=torch.int32),
                                                 torch.arange(reqs, dtype=torch.int64))})
        best = [float("inf")] * len(variants)
        best_cpu = [float("inf")] * len(variants)  # process CPU time: less moved by other processes' load
        for _ in range(ns.rounds):
            for j, scored in enumerate(variants):  # taking turns: both see the same machine
                t0, c0 = time.perf_counter(), time.process_time()
                plan = kernels.attention_plan(qsl, seq_lens, h, kvh, d) if hasattr(kernels, "attention_plan") else None
                extra = {} if plan is None else {"plan": plan}
                scored = dict(scored)
                if "key_mass" in scored:
                    scored["key_mass"].mass.zero_()  # once per step, as the engine allocates it
                for cache in scored.pop("caches", caches):
                    kernels.attention(q, k, v, cache[0], cache[1], table, qsl, seq_lens, cos_sin, out, d ** -0.5,
                                      **extra, **scored)
                best[j] = min(best[j], time.perf_counter() - t0)
                best_cpu[j] = min(best_cpu[j], time.process_time() - c0)
        line = f"{reqs:4d} requests x {keys:5d} keys: {best[0] * 1e3:8.2f} ms per step"
        for j, (name, _) in enumerate(other_caches, start=1):
            line += (f", {name} {best[j] * 1e3:8.2f} ms ({best[j] / best[0]:.2f}x); CPU time "
                     f"{best_cpu[0] * 1e3:.2f} -> {best_cpu[j] * 1e3:.2f} ms ({best_cpu[j] / best_cpu[0]:.2f}x)")
        if ns.key_mass:
            line += f", scored {best[-1] * 1e3:8.2f} ms ({100 * (best[-1] / best[0] - 1):+.1f}%)"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
