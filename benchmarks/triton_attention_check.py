#!/usr/bin/env python3
"""The triton attention backend alone on a GPU: its compiled kernels against the reference backend, then its time
per step beside cpu-torch's (the batched torch ops ``auto`` ran before) and the HBM bandwidth its K/V reads reach.

    PYTHONPATH=. python benchmarks/triton_attention_check.py               # on a GPU: ~1 minute
    PYTHONPATH=. python benchmarks/triton_attention_check.py --device cpu  # a dry run: the checks, interpreted

The first thing a GPU session runs (docs/gpu.md), before ``cuda_check.py``: if the kernels compiled for the device
disagree with the reference, this says which case. Correctness: the CPU tests' cases (mixed steps, head sizes 64
and 128, GQA groups, block sizes, windows over tables with holes, bfloat16) on the device. Speed (``--device
cuda`` only): a decode-only step and a mixed step of TinyLlama-1.1B's attention shape (32 heads, 4 KV heads, head
size 64, blocks of 16) in bfloat16, one layer, CUDA events over ``--iters`` calls. Exits non-zero when a check
fails.
"""

from __future__ import annotations

import argparse
import os
import sys

CASES = [  # (name, requests as (cached, new), block size, heads, KV heads, head size, dtype, window, null blocks)
    ("mixed d64 group 2", [(40, 1), (3, 1), (17, 1), (0, 20), (17, 5), (33, 9)], 16, 4, 2, 64, "float32", 0, {}),
    ("mixed d128 group 4", [(40, 1), (3, 1), (0, 20), (33, 9), (300, 64)], 16, 8, 2, 128, "float32", 0, {}),
    ("mixed d64 group 3, blocks of 8", [(9, 1), (0, 33), (20, 7)], 8, 6, 2, 64, "float32", 0, {}),
    ("decodes d64 group 8", [(c, 1) for c in (0, 1, 15, 16, 31, 32, 33, 70, 500)], 16, 32, 4, 64, "float32", 0, {}),
    ("window 24 over null blocks", [(60, 1), (45, 1), (50, 12)], 8, 4, 2, 64, "float32", 24, {0: 4, 1: 2, 2: 3}),
    ("bfloat16 d128", [(40, 1), (3, 1), (0, 20), (17, 5), (200, 40)], 16, 8, 2, 128, "bfloat16", 0, {}),
]
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


def check(device: str) -> bool:
    import torch

    from conveyor.layers.attention import make_attention
    from tests.helpers.paged_steps import make_step

    ok = True
    for name, reqs, block_size, heads, kv_heads, head_dim, dtype, window, null in CASES:
        dt = getattr(torch, dtype)
        meta, q, k, v, cache = make_step(reqs, block_size, heads, kv_heads, head_dim, dt, null_blocks=null,
                                         device=device)
        outs = {}
        for backend in ("triton", "reference"):
            if window and backend == "reference":  # the reference gathers whole tables: the NaN holes poison it
                cache = cache.nan_to_num()
            written = cache.clone()
            outs[backend] = make_attention(backend, meta, dt).forward(q, k, v, written, head_dim ** -0.5,
                                                                     window=window)
        diff = (outs["triton"].float() - outs["reference"].float()).abs().max().item()
        good = diff <= TOLERANCE[dtype] and not outs["triton"].isnan().any()
        ok &= good
        print(f"  {name:<32} max |triton - reference| {diff:.2e}  {'ok' if good else 'FAIL'}", flush=True)
    return ok


def timed(fn, iters: int) -> float:
    """Mean ms per call, CUDA events, after a warm-up call (which compiles)."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def speed(iters: int, bandwidth: float | None) -> None:
    import torch

    from conveyor.layers.attention import make_attention
    from tests.helpers.paged_steps import make_step

    heads, kv_heads, head_dim = 32, 4, 64
    steps = {"decode 256 x 512 keys": [(511, 1)] * 256, "decode 1 x 384 keys": [(383, 1)],
             "mixed: 128 decodes + 4 x 512-token prompts": [(511, 1)] * 128 + [(0, 512)] * 4}
    for name, reqs in steps.items():
        meta, q, k, v, cache = make_step(reqs, 16, heads, kv_heads, head_dim, torch.bfloat16, device="cuda")
        cache = cache.nan_to_num()  # cpu-torch's decode gathers read whole blocks
        kv_bytes = 2 * sum(meta.seq_lens) * kv_heads * head_dim * 2
        line = f"  {name:<44}"
        for backend in ("triton", "cpu-torch"):
            attn = make_attention(backend, meta, torch.bfloat16)
            ms = timed(lambda: attn.forward(q, k, v, cache, head_dim ** -0.5), iters)
            line += f" {backend} {ms * 1e3:8.1f} us"
            if backend == "triton":
                gbs = kv_bytes / ms / 1e6
                line += f" ({gbs:.0f} GB/s of K/V" + (f", {gbs * 1e9 / bandwidth:.0%} of HBM)" if bandwidth else ")")
        print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the checks under Triton's interpreter")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: its kernels then run on the CPU
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    import triton

    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none (interpreter)"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {gpu}", flush=True)
    ok = check(args.device)
    if args.device == "cuda":
        from conveyor.sim.hardware import get_hardware

        names = {"H200": "h200", "H100": "h100-sxm", "A100": "a100-80gb"}
        hw = next((get_hardware(v) for key, v in names.items() if key in gpu), None)
        speed(args.iters, hw.mem_bandwidth if hw else None)
    print("kernels:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
