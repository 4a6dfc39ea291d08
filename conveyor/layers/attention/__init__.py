"""Attention backends behind one interface.

``make_attention(backend, meta, dtype)`` turns the step's ``AttentionMetadata`` into an object with
``forward(q, k, v, kv_cache, scale) -> out`` that every layer calls; all per-step preparation happens once, in
its constructor. ``forward`` first writes the K/V of ALL new tokens into the paged cache, then reads.
Backends: "reference" (the oracle), "cpu" (batched torch, default on CPU), "cuda" (flash-attn varlen when
installed, else the batched torch path), "auto" (cuda on a GPU, cpu otherwise).
"""

from __future__ import annotations

import torch

from conveyor.layers.attention.cpu import CpuAttention
from conveyor.layers.attention.cuda import make_cuda_attention
from conveyor.layers.attention.metadata import AttentionMetadata
from conveyor.layers.attention.native_cpu import NativeCpuAttention
from conveyor.layers.attention.reference import ReferenceAttention

BACKENDS = ("auto", "reference", "cpu", "cuda")


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype | None = None,
                    head_dim: int | None = None) -> str:
    """The backend a step runs: "auto" -> "cuda" on a GPU, else "cpu"; "cpu" -> "cpu-native" (the one-kernel
    path) when the native CPU kernels built here and serve ``dtype`` and ``head_dim``."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        name = "cuda" if torch.device(device).type == "cuda" else "cpu"
    if name == "cpu" and torch.device(device).type == "cpu" and dtype is not None and head_dim is not None:
        from conveyor.kernels import load_cpu_kernels

        kernels = load_cpu_kernels()
        if kernels is not None and kernels.supports(dtype, head_dim):
            return "cpu-native"
    return name


def make_attention(backend: str, meta: AttentionMetadata, dtype: torch.dtype):
    """The per-step attention object for a resolved backend name."""
    if backend == "reference":
        return ReferenceAttention(meta)
    if backend == "cpu":
        return CpuAttention(meta, dtype)
    if backend == "cpu-native":
        from conveyor.kernels import load_cpu_kernels

        return NativeCpuAttention(meta, load_cpu_kernels())
    if backend == "cuda":
        return make_cuda_attention(meta, dtype)
    raise ValueError(f"unknown attention backend {backend!r}")


__all__ = ["AttentionMetadata", "BACKENDS", "make_attention", "resolve_backend"]
