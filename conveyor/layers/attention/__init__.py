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
from conveyor.layers.attention.reference import ReferenceAttention

BACKENDS = ("auto", "reference", "cpu", "cuda")


def resolve_backend(name: str, device: torch.device | str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "cuda" if torch.device(device).type == "cuda" else "cpu"
    return name


def make_attention(backend: str, meta: AttentionMetadata, dtype: torch.dtype):
    """The per-step attention object for a resolved backend name."""
    if backend == "reference":
        return ReferenceAttention(meta)
    if backend == "cpu":
        return CpuAttention(meta, dtype)
    if backend == "cuda":
        return make_cuda_attention(meta, dtype)
    raise ValueError(f"unknown attention backend {backend!r}")


__all__ = ["AttentionMetadata", "BACKENDS", "make_attention", "resolve_backend"]
