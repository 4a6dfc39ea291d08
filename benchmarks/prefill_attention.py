#!/usr/bin/env python3
"""Prefill attention, bfloat16: the native kernel's AMX (or VDPBF16PS) path against its float32 FMA path, alternated.

    python benchmarks/prefill_attention.py [--heads 9 --kv-heads 3] [--prompts 975,835,654,300,200,120,80,60,40,30,20,16]

One attention call over the given prompts (fresh prefills, block size 16, as a 2048-token prefill step of
workload_longtail_v1 has them), with ``CpuKernels.set_amx_attention`` on and off in turn (best of 3 x 8 rounds);
on a CPU without AMX but with AVX512_BF16 (Zen 4/5), ``CpuKernels.set_dot_attention`` (VDPBF16PS) instead;
prints ms per call, causal GFLOP/s and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--prompts", default="975,835,654,300,200,120,80,60,40,30,20,16")
    ap.add_argument("--rounds", type=int, default=8)
    ns = ap.parse_args()

    import torch

    from conveyor.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        print("no native kernels here: nothing to compare")
        return 1
    if kernels.set_amx_attention(True):
        name, switch = "AMX tiles", kernels.set_amx_attention
        kernels.set_dot_attention(False)  # AMX off: the float32 FMA loop
    elif kernels.set_dot_attention(True):
        name, switch = "VDPBF16PS", kernels.set_dot_attention
    else:
        print("neither AMX nor AVX512_BF16 attention on this CPU: nothing to compare")
        return 1
    h, kvh, d, bs = ns.heads, ns.kv_heads, ns.head_dim, 16
    lens = [int(x) for x in ns.prompts.split(",")]
    blocks = [-(-n // bs) for n in lens]
    cache = torch.zeros(2, sum(blocks), kvh, bs, d, dtype=torch.bfloat16)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int64)
    first = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.arange(first, first + n)
        first += n
    starts = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    qkv = torch.randn(sum(lens), h + 2 * kvh, d).to(torch.bfloat16)

    def run() -> torch.Tensor:
        x, out = qkv.clone(), torch.empty(sum(lens), h, d, dtype=torch.bfloat16)
        kernels.attention(x[:, :h], x[:, h:h + kvh], x[:, h + kvh:], cache[0], cache[1], table, starts, seq_lens,
                          None, out, d ** -0.5)
        return out

    outs, best = {}, {True: float("inf"), False: float("inf")}
    for _ in range(ns.rounds):
        for amx in (True, False):
            switch(amx)
            outs[amx] = run()
            t = time.perf_counter()
            for _ in range(3):
                run()
            best[amx] = min(best[amx], (time.perf_counter() - t) / 3)
    switch(True)
    kernels.set_dot_attention(True)
    flop = sum(n * n / 2 for n in lens) * h * d * 4
    print(f"{h} q / {kvh} kv heads, head_dim {d}, prompts {ns.prompts}, {torch.get_num_threads()} threads")
    for amx in (False, True):
        print(f"{name if amx else 'vector FMA':10s} {best[amx] * 1e3:7.2f} ms  {flop / best[amx] / 1e9:5.0f} GFLOP/s")
    print(f"speed-up {best[False] / best[True]:.2f}x; max |{name} - vector| "
          f"{(outs[True].float() - outs[False].float()).abs().max().item():.4f} (bfloat16 outputs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
