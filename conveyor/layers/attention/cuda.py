"""CUDA attention: flash-attn's varlen paged kernel when installed, otherwise the batched torch path.

There is no GPU on the development machines, so this stays small and correct by construction: with
flash-attn it hands the whole step to ``flash_attn_varlen_func`` (paged K/V through ``block_table``);
without it, the CPU backend's batched torch ops run unchanged on the GPU.
"""

from __future__ import annotations

import torch

from conveyor.layers.attention.base import AttentionBackend
from conveyor.layers.attention.common import write_kv
from conveyor.layers.attention.cpu import CpuAttention
from conveyor.layers.attention.metadata import AttentionMetadata

try:  # optional dependency
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_varlen_func = None


def flash_attn_available() -> bool:
    return flash_attn_varlen_func is not None


class FlashAttention:
    """One varlen call per layer over all real requests; requires flash-attn and block_size % 256 == 0."""

    name = "flash"

    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        n = meta.num_reqs
        device = meta.slot_mapping.device
        self.cu_q = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device)
        self.cu_k = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.cu_k[1:] = torch.tensor(meta.seq_lens, dtype=torch.int32, device=device).cumsum(0)
        self.max_q = max((b - a for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:])), default=0)
        self.max_k = max(meta.seq_lens, default=0)
        self.block_table = meta.block_table.to(torch.int32)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                scale: float) -> torch.Tensor:
        meta = self.meta
        write_kv(kv_cache, k, v, meta)
        if not meta.num_reqs:
            return torch.empty_like(q)
        return flash_attn_varlen_func(
            q, kv_cache[0], kv_cache[1], cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k,
            max_seqlen_q=self.max_q, max_seqlen_k=self.max_k, softmax_scale=scale, causal=True,
            block_table=self.block_table)


def make_cuda_attention(meta: AttentionMetadata, dtype: torch.dtype) -> AttentionBackend:
    if flash_attn_available() and meta.block_size % 256 == 0:
        return FlashAttention(meta)
    return CpuAttention(meta, dtype)
