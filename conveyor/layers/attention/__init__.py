"""Attention backends behind one interface (``base.AttentionBackend``).

``make_attention(backend, meta, dtype, padding)`` turns the step's ``AttentionMetadata`` into an object with
``forward(q, k, v, kv_cache, scale) -> out`` that every layer calls; all per-step preparation happens once, in
its constructor. ``forward`` first writes the K/V of ALL new tokens into the paged cache, then reads.
Backends: "reference" (the oracle), "cpu" (on CPU: resolved to "cpu-native", one native kernel call per layer
for the whole step, where conveyor/kernels built for this CPU and serve the dtype and head size; else the
batched torch path), "cpu-torch" (the torch path even where the native kernels run), "cuda" (flash-attn varlen when installed, else the batched
torch path), "auto" (cuda on a GPU, cpu otherwise). A step with a baseline's pad rows gets its backend wrapped
in ``padded.PaddedAttention``.
"""

from __future__ import annotations

import torch

from conveyor.layers.attention.base import AttentionBackend
from conveyor.layers.attention.cpu import CpuAttention
from conveyor.layers.attention.cuda import make_cuda_attention
from conveyor.layers.attention.metadata import AttentionMetadata
from conveyor.layers.attention.native_cpu import NativeCpuAttention
from conveyor.layers.attention.padded import PaddedAttention, Padding
from conveyor.layers.attention.reference import ReferenceAttention

BACKENDS = ("auto", "reference", "cpu", "cpu-torch", "cuda")


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


def make_attention(backend: str, meta: AttentionMetadata, dtype: torch.dtype,
                   padding: Padding | None = None) -> AttentionBackend:
    """The per-step attention object for a resolved backend name; with ``padding``, wrapped to run the pad rows."""
    attention = _make_backend(backend, meta, dtype)
    return attention if padding is None else PaddedAttention(attention, meta.num_tokens, padding)


def _make_backend(backend: str, meta: AttentionMetadata, dtype: torch.dtype) -> AttentionBackend:
    if backend == "reference":
        return ReferenceAttention(meta)
    if backend == "cpu":
        return CpuAttention(meta, dtype)
    if backend == "cpu-native":
        from conveyor.kernels import load_cpu_kernels

        return NativeCpuAttention(meta, load_cpu_kernels())
    if backend == "cpu-torch":
        return CpuAttention(meta, dtype)
    if backend == "cuda":
        return make_cuda_attention(meta, dtype)
    raise ValueError(f"unknown attention backend {backend!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "Padding", "make_attention", "resolve_backend"]
