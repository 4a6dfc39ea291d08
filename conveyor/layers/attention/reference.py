"""The reference attention backend: one request at a time, plain torch, explicit causal mask. The test oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.layers.attention.base import reject_rope, token_major_kv_shape, window_allows
from conveyor.layers.attention.common import gather_context, write_kv
from conveyor.layers.attention.metadata import AttentionMetadata


class ReferenceAttention:
    """Gathers every request's whole context by block table and runs SDPA with a hand-built mask."""

    name = "reference"
    fuses_rope = False
    cache_needs_zeroing = False  # reads only the slots of each request's context
    supports_layer_stack = False
    kv_cache_shape = staticmethod(token_major_kv_shape)

    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                scale: float, rope: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        """q [T, H, d], k/v [T, KVH, d] for the new tokens; returns [T, H, d] (``window``: see base)."""
        reject_rope(self.name, rope)
        meta = self.meta
        write_kv(kv_cache, k, v, meta)
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        for i, seq_len in enumerate(meta.seq_lens):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            computed = meta.num_computed[i]
            ctx_k, ctx_v = gather_context(kv_cache, meta.block_table[i], seq_len)
            # Query j sits at position computed + j and sees keys 0 .. computed + j (the last `window` of them).
            allowed = window_allows(torch.arange(computed, seq_len, device=q.device),
                                    torch.arange(seq_len, device=q.device), window)  # [n, seq_len]
            qh = q[start:end].transpose(0, 1).float()  # [H, n, d]
            kh = ctx_k.transpose(0, 1).repeat_interleave(group, dim=0).float()  # [H, seq_len, d]
            vh = ctx_v.transpose(0, 1).repeat_interleave(group, dim=0).float()
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale)
            out[start:end] = o.transpose(0, 1).to(q.dtype)
        return out
