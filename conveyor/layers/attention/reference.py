"""The reference attention backend: one request at a time, plain torch, explicit causal mask. The test oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.layers.attention.base import window_allows
from conveyor.layers.attention.common import TorchAttention, gather_context


class ReferenceAttention(TorchAttention):
    """Gathers every request's whole context by block table and runs SDPA with a hand-built mask."""

    name = "reference"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float,
               window: int) -> torch.Tensor:
        meta = self.meta
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
