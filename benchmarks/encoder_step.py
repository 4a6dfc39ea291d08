#!/usr/bin/env python3
"""One encoder step of all-MiniLM-L6-v2: the native packed attention against one torch SDPA call per sequence,
on the same weights in one process, alternated.

    python benchmarks/encoder_step.py [--passages 40] [--threads 1,2] [--dtype bfloat16,float32] [--rounds 3]

A step of ``--passages`` sequences of 20-400 tokens (uniform, from a seed; the packed token axis the engine builds,
as ``--max-num-batched-tokens 8192`` fills it) runs through the whole encoder (``BertEncoder.forward``) and through
attention alone (``layers.attention.packed.packed_attention``, one layer's q/k/v), with the kernels handed to the
attention layers and with None (the torch path). Each round times both forms, best of 5 calls each; printed: ms per
step / per attention call, the ratio, attention's GFLOP/s, and the largest difference between the two hidden states.
Report ``uptime`` beside the numbers: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import random
import time


def best_ms(fn, calls: int = 5) -> float:
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passages", type=int, default=40)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtype", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args()

    import torch

    from benchmarks.embed_throughput import minilm_dir
    from conveyor.kernels import load_cpu_kernels
    from conveyor.layers.attention.packed import PackedSequences, packed_attention
    from conveyor.models.bert import BertSelfAttention
    from conveyor.models.loader import load_model

    kernels = load_cpu_kernels()
    if kernels is None:
        print("no native kernels here: nothing to compare")
        return 1
    rng = random.Random(0)
    lengths = [rng.randint(20, 400) for _ in range(ns.passages)]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    tokens = starts[-1]
    input_ids = torch.randint(1000, 20000, (tokens,), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])
    token_types = torch.zeros(tokens, dtype=torch.int64)
    print(f"{ns.passages} passages, {tokens} tokens, kernels {kernels.level}; uptime: {os.popen('uptime').read().strip()}")
    for dtype in ns.dtype.split(","):
        net, _ = load_model(minilm_dir(), dtype=dtype)
        attn_layers = [m for m in net.modules() if isinstance(m, BertSelfAttention)]
        heads, head_dim = attn_layers[0].num_heads, attn_layers[0].head_dim
        qkv = torch.randn(tokens, 3, heads, head_dim).to(getattr(torch, dtype))
        out = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype)
        seqs = PackedSequences.of(starts)
        flops = 4 * heads * head_dim * sum(n * n for n in lengths)  # q k^T and p v

        def step(with_kernels: bool) -> torch.Tensor:
            for m in attn_layers:
                m.kernels = kernels if with_kernels else None
            with torch.inference_mode():
                return net(input_ids, positions, token_types, starts)

        for threads in (int(t) for t in ns.threads.split(",")):
            torch.set_num_threads(threads)
            diff = (step(True).float() - step(False).float()).abs().max().item()
            for r in range(ns.rounds):
                ms = {name: best_ms(lambda: step(name == "native")) for name in ("native", "sdpa")}
                att = {name: best_ms(lambda: packed_attention(qkv, out, seqs, kernels if name == "native" else None))
                       for name in ("native", "sdpa")}
                print(f"{dtype} {threads} thread(s) round {r + 1}: step native {ms['native']:.0f} ms, sdpa "
                      f"{ms['sdpa']:.0f} ms ({ms['sdpa'] / ms['native']:.2f}x); attention call native "
                      f"{att['native']:.1f} ms ({flops / att['native'] / 1e6:.0f} GFLOP/s), sdpa {att['sdpa']:.1f} ms "
                      f"({flops / att['sdpa'] / 1e6:.0f} GFLOP/s, {att['sdpa'] / att['native']:.2f}x); "
                      f"max |diff| {diff:.2e}; load {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
