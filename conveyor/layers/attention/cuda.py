"""The "cuda" attention backend: flash-attn's varlen paged kernel.

There is no GPU on the development machines, so this stays small and correct by construction: it hands the
whole step to ``flash_attn_varlen_func`` (paged K/V through ``block_table``). Without flash-attn (or with a
block size it does not take) "cuda" resolves to "cpu-torch", whose batched torch ops run unchanged on a GPU.
"""

from __future__ import annotations

import torch

from conveyor.layers.attention.common import TorchAttention
from conveyor.layers.attention.metadata import AttentionMetadata

try:  # optional dependency
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_varlen_func = None


def flash_attn_available() -> bool:
    return flash_attn_varlen_func is not None


class FlashAttention(TorchAttention):
    """One varlen call per layer over all real requests; requires flash-attn and block_size % 256 == 0."""

    name = "cuda"

    def __init__(self, meta: AttentionMetadata, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(meta, dtype)
        n = meta.num_reqs
        device = meta.slot_mapping.device
        self.cu_q = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device)
        self.cu_k = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.cu_k[1:] = torch.tensor(meta.seq_lens, dtype=torch.int32, device=device).cumsum(0)
        self.max_q = max((b - a for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:])), default=0)
        self.max_k = max(meta.seq_lens, default=0)
        self.block_table = meta.block_table.to(torch.int32)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float,
               window: int) -> torch.Tensor:
        if not self.meta.num_reqs:
            return torch.empty_like(q)
        return flash_attn_varlen_func(
            q, kv_cache[0], kv_cache[1], cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k,
            max_seqlen_q=self.max_q, max_seqlen_k=self.max_k, softmax_scale=scale, causal=True,
            window_size=(window - 1, 0) if window else (-1, -1), block_table=self.block_table)


def flash_attention_serves(block_size: int) -> bool:
    """Whether the "cuda" backend can run: flash-attn installed, and the block size its paged kernel takes."""
    return flash_attn_available() and block_size % 256 == 0
