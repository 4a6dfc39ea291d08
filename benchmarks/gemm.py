#!/usr/bin/env python3
"""Linear layers at decode-sized batches: conveyor's native skinny GEMM against oneDNN's prepacked one.

    python benchmarks/gemm.py [--dtype float32] [--rows 1,8,32,64,96] [--shapes 576x960,576x576,576x3072,1536x576]
                              [--copies 30]

For each row count, one "layer set" (the given in x out shapes: by default SmolLM2-135M's qkv, o, gate_up and down)
is run through ``PackedLinear`` forced onto the native kernel and through oneDNN's prepacked path, alternated
(best of 5, twice each), and prints ms per set, GFLOP/s and the ratio. This is where ``SKINNY_MAX_ROWS`` and
``AMX_MAX_ROWS`` in ``conveyor/layers/linear.py`` started from (the GEMM alone; the limits themselves were set on
whole decode steps, where the native layer stack saves more than the GEMM). bfloat16 runs natively on AMX tiles
or, without AMX, on AVX512_BF16's VDPBF16PS (``BF16_DOT_MAX_ROWS``); not below the avx512bf16 level.

``--copies N`` holds N copies of every weight (distinct memory) and runs the layer set on each copy in turn, as a
model's layers stream from memory one after another (one set alone stays in L2).
"""

from __future__ import annotations

import argparse
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="1,8,32,48,64,96,128")
    ap.add_argument("--shapes", default="576x960,576x576,576x3072,1536x576", help="in x out, comma-separated")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--copies", type=int, default=1, help="copies of every weight, run in turn (see above)")
    ns = ap.parse_args()

    import torch

    from conveyor.kernels import load_cpu_kernels
    from conveyor.layers.linear import pack_linear

    if ns.threads:
        torch.set_num_threads(ns.threads)
    kernels = load_cpu_kernels()
    dtype = getattr(torch, ns.dtype)
    if kernels is None or (dtype == torch.bfloat16 and not (kernels.amx or kernels.bf16_dot)):
        print("no native kernel for this dtype on this CPU: nothing to compare")
        return 1
    shapes = [tuple(int(v) for v in s.split("x")) for s in ns.shapes.split(",")]
    native, onednn = [], []
    for _ in range(ns.copies):
        weights = [(torch.randn(n, k) * 0.02).to(dtype) for k, n in shapes]
        native.append([pack_linear(w, None, kernels) for w in weights])
        for layer in native[-1]:
            layer.max_rows = 1 << 30  # always the native kernel, whatever the row count
        onednn.append([pack_linear(w, None, None) for w in weights])

    def best_ms(copies, xs, reps=10) -> float:
        """ms per layer set, best of 5 passes of ``reps`` sets (each pass runs every copy in turn)."""
        reps = max(reps, len(copies))
        for _ in range(2):
            for layers in copies:
                for layer in layers:
                    layer(xs[layer.in_features])
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for i in range(reps):
                for layer in copies[i % len(copies)]:
                    layer(xs[layer.in_features])
            best = min(best, (time.perf_counter() - t) / reps)
        return best * 1e3

    print(f"{ns.dtype}, {torch.get_num_threads()} threads, kernels {kernels.level}"
          f"{' (AMX)' if kernels.amx else ''}, shapes {ns.shapes}, {ns.copies} cop{'y' if ns.copies == 1 else 'ies'}")
    print("rows | native ms | oneDNN ms | native GFLOP/s | oneDNN GFLOP/s | native / oneDNN time")
    for m in (int(r) for r in ns.rows.split(",")):
        xs = {k: torch.randn(m, k).to(dtype) for k, _ in shapes}
        flop = sum(2 * m * k * n for k, n in shapes) / 1e6
        a, b = float("inf"), float("inf")
        for _ in range(2):  # alternated, so drift on a shared machine hits both
            a, b = min(a, best_ms(native, xs)), min(b, best_ms(onednn, xs))
        print(f"{m:4d} | {a:9.3f} | {b:9.3f} | {flop / a:14.0f} | {flop / b:14.0f} | {a / b:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
