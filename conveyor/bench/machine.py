"""Measure this machine's roofline: matmul rate (float32, or the dtype a run used) and memory bandwidth, right now.

The machine is shared and noisy, so benchmarks measure it in the same run they report ratios against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class MachineRoofline:
    matmul_gflops: float  # square GEMM of side ``square_n``, in ``dtype``
    skinny_gflops: float  # decode-like [32 x 512] @ [512 x 1536], in ``dtype``
    mem_bandwidth_gbs: float  # read + write of a large copy
    square_n: int = 2048
    dtype: str = "float32"

    def describe(self) -> str:
        return (f"{self.dtype} matmul {self.matmul_gflops:.0f} GFLOP/s (square {self.square_n}), "
                f"{self.skinny_gflops:.0f} GFLOP/s (decode-like 32x512x1536), memory {self.mem_bandwidth_gbs:.1f} GB/s "
                f"(copy)")


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_gflops(m: int, k: int, n: int, device: str = "cpu", calls: int = 1, repeats: int = 3,
                dtype: str = "float32") -> float:
    """Best-of-``repeats`` rate of ``calls`` back-to-back [m x k] @ [k x n] matmuls in ``dtype`` on ``device``,
    GFLOP/s."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a = torch.randn(m, k, device=device).to(getattr(torch, dtype))
    b = torch.randn(k, n, device=device).to(getattr(torch, dtype))

    def run():
        for _ in range(calls):
            torch.mm(a, b)
        sync()

    return calls * 2 * m * k * n / _best_time(run, repeats) / 1e9


def measure_roofline(device: str = "cpu", quick: bool = False, dtype: str = "float32") -> MachineRoofline:
    """Best-of-N timings of a square GEMM and a skinny GEMM (both in ``dtype``: compare a run with the rate of the
    dtype it ran in) and a large copy on ``device``."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    n = 1024 if quick else 2048
    matmul = gemm_gflops(n, n, n, device, dtype=dtype)
    skinny_rate = gemm_gflops(32, 512, 1536, device, calls=50, dtype=dtype)
    numel = (32 if quick else 128) * (1 << 20) // 4
    src = torch.empty(numel, device=device).fill_(1.0)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
        sync()

    bandwidth = 2 * numel * 4 / _best_time(copy, 5) / 1e9
    return MachineRoofline(matmul, skinny_rate, bandwidth, n, dtype)
