#!/usr/bin/env python3
"""Linear layers on quantized weights, per row count: the integer-dot-product kernel against dequantizing the
weight and running the float GEMM, with the float layer (oneDNN / the native skinny GEMM) beside them.

    python benchmarks/gemm_quant.py [--format Q4_1] [--dtype float32] [--rows 1,4,16,64,128,256,512]
                                    [--shapes 576x960,576x576,576x3072,1536x576] [--copies 30]

A "layer set" is the given in x out shapes (by default SmolLM2-135M's qkv, o, gate_up and down); each path runs
it alternated with the others, best of 5. ``QUANT_INT_MAX_ROWS`` in conveyor/layers/quantized.py comes from
where the integer column stops winning. On a CPU with AMX-INT8 the integer kernel runs twice, on the VNNI loop
and on the tiles at every row count: ``AMX_QDOT_MIN_ROWS`` in csrc/kernels.h comes from where the tiles start
to win.

``--format w8a8`` (layers/w8a8.py: per-channel int8 weights, per-token int8 activations) compares its native VNNI
loop ("int dot") with oneDNN's s8s8s32 GEMM (``torch._int_mm``) between the native quantize and epilogue passes
(in the "dequant + float GEMM" column): ``W8A8_NATIVE_MAX_ROWS`` comes from where the loop stops winning.

``--widened`` (a 5-bit format: Q5_0, Q5_1, Q5_K) adds the same weights widened to 8-bit q (csrc/cvk.h's CVK_Q8, how
they were packed before CVK_Q5) on the same loop: ``kQ5ExpandTiles`` in csrc/gemm_quant.cpp comes from the row
count where the 5-bit column's expansion pass starts to pay.

``--copies N`` holds N copies of every weight (distinct memory) and runs the layer set on each copy in turn, as a
decode step runs every layer once: with N x the set's bytes beyond the caches (SmolLM2's 30 layers: 66 MB of
Q4_1) the weights stream from memory as they do in a model, instead of staying in L2 between repetitions.
"""

from __future__ import annotations

import argparse
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--format", default="Q4_1", help="a GGUF type with a kernel (Q8_0, Q4_0, Q4_1, Q4_K, ...), int8 or w8a8")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="1,4,16,64,128,256,512")
    ap.add_argument("--shapes", default="576x960,576x576,576x3072,1536x576", help="in x out, comma-separated")
    ap.add_argument("--copies", type=int, default=1, help="copies of every weight, run in turn (see above)")
    ap.add_argument("--widened", action="store_true", help="5-bit formats: also the weights widened to 8-bit q")
    ns = ap.parse_args()

    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf import quants as gq

    from dataclasses import replace

    from conveyor.kernels import load_cpu_kernels
    from conveyor.layers.gguf_blocks import from_gguf
    from conveyor.layers.linear import pack_linear
    from conveyor.layers.quantized import QuantLinear, quantize_int8
    from conveyor.layers.w8a8 import W8A8Linear

    kernels = load_cpu_kernels()
    if kernels is None:
        print("no native kernels on this CPU: nothing to compare")
        return 1
    dtype = getattr(torch, ns.dtype)
    shapes = [tuple(int(v) for v in s.split("x")) for s in ns.shapes.split(",")]
    rng = np.random.default_rng(0)
    quant, floats = [[] for _ in range(ns.copies)], [[] for _ in range(ns.copies)]
    wide = [[] for _ in range(ns.copies)] if ns.widened else None
    for k, n in shapes:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
        if ns.format == "w8a8":
            for copy in range(ns.copies):
                layer = W8A8Linear.from_float(torch.from_numpy(w), None, kernels, dtype)
                quant[copy].append(layer)
                floats[copy].append(pack_linear(layer.q_t.t().to(dtype) * layer.w_scale[:n, None].to(dtype), None,
                                                kernels))
            continue
        if ns.format == "int8":
            qt = quantize_int8(torch.from_numpy(w))
        else:
            raw = gq.quantize(w, GGMLQuantizationType[ns.format]).reshape(-1)
            qt = from_gguf(raw, ns.format, (n, k))
        for copy in range(ns.copies):
            quant[copy].append(QuantLinear(qt, None, kernels, dtype))
            if wide is not None:
                if qt.kind != "q5":
                    raise SystemExit(f"--widened compares 5-bit formats; {ns.format} is {qt.kind}")
                wide[copy].append(QuantLinear(replace(qt, kind="q8"), None, kernels, dtype))
            floats[copy].append(pack_linear(qt.dequantize(dtype), None, kernels))

    def path(copies, max_rows):
        for layer in (layer for layers in copies for layer in layers):
            layer.max_rows = max_rows
        return copies

    def best_ms(copies, xs, reps) -> float:
        """ms per layer set, best of 5 passes of ``reps`` sets (each pass runs every copy in turn)."""
        reps = max(reps, len(copies))
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

    print(f"{ns.format} weights, {ns.dtype} activations, {torch.get_num_threads()} threads, kernels {kernels.level}"
          f"{' (VNNI)' if kernels.vnni else ''}, shapes {ns.shapes}, {ns.copies} "
          f"cop{'y' if ns.copies == 1 else 'ies'}")
    amx = kernels.amx_int8
    print("rows | int dot ms" + (" (VNNI) | int dot on AMX-INT8 ms | AMX / VNNI" if amx else "")
          + (" | widened to 8-bit ms | 5-bit / 8-bit" if wide else "")
          + (" | oneDNN s8s8s32 + native passes ms |" if ns.format == "w8a8" else " | dequant + float GEMM ms |")
          + " float weights ms | best int / dequant | best int / float")
    print("---|---" + ("|---|---" if amx else "") + ("|---|---" if wide else "") + "|---|---|---|---")
    for m in [int(r) for r in ns.rows.split(",")]:
        xs = {k: torch.randn(m, k).to(dtype) for k, _ in shapes}
        reps = max(1, 2000 // (m * 10))
        kernels.set_amx_qdot(False)
        t_int = best_ms(path(quant, 1 << 30), xs, reps)
        cells = f"{t_int:.3f}"
        if amx:
            kernels.set_amx_qdot(True, min_rows=1)
            t_amx = best_ms(path(quant, 1 << 30), xs, reps)
            cells += f" | {t_amx:.3f} | {t_amx / t_int:.2f}"
            t_int = min(t_int, t_amx)
        if wide:
            t_wide = best_ms(path(wide, 1 << 30), xs, reps)
            cells += f" | {t_wide:.3f} | {t_int / t_wide:.2f}"
        t_deq = best_ms(path(quant, 0), xs, reps)
        t_float = best_ms(floats, xs, reps)
        print(f"{m} | {cells} | {t_deq:.3f} | {t_float:.3f} | {t_int / t_deq:.2f} | {t_int / t_float:.2f}")
    kernels.set_amx_qdot(True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
