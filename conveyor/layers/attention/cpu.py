"""The torch CPU attention backend: what runs where the native kernels do not (no AVX2, no compiler,
``CONVEYOR_CPU_ISA=none``, float16, or a head size that is not whole vectors), and the oracle-grade fallback.

Decodes (one query each) are batched: the runner sorts them by context length, we cut them into a few length
buckets, gather each bucket's K/V blocks into one padded tensor and run one masked SDPA per bucket. So a step
with 100 decodes costs a handful of calls per layer instead of 100, and everything that does not depend on the
layer (bucket bounds, flat block ids, masks, gather buffers) is built once per step in ``__init__``.
Prefill chunks run one request at a time: without prior context straight on the fresh K/V (no gather).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from conveyor.layers.attention.common import TorchAttention, attend_with_context, gather_context, sdpa
from conveyor.layers.attention.metadata import AttentionMetadata

# A bucket keeps taking shorter requests while the padding it adds stays under this fraction of its length.
MAX_BUCKET_PAD_FRACTION = 0.35


@dataclass
class DecodeBucket:
    start: int  # first request (== first query row: decodes have one token each)
    end: int
    flat_block_ids: torch.Tensor  # [(end - start) * num_blocks] int64
    num_blocks: int
    mask: torch.Tensor  # [b, 1, 1, num_blocks * block_size] additive: 0 inside the context, -inf beyond
    lens: torch.Tensor  # [b, 1] the requests' context lengths (for the windowed layers' masks)
    k_buf: torch.Tensor | None = None  # gather targets, allocated once per step and reused by every layer
    v_buf: torch.Tensor | None = None
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its mask, built once per step

    def mask_for(self, window: int) -> torch.Tensor:
        """The additive mask of a layer with this sliding window (0: ``mask``): keys before the last ``window``
        of each request's context hidden too."""
        if not window:
            return self.mask
        if window not in self.window_masks:
            slots = torch.arange(self.mask.shape[-1], device=self.mask.device).unsqueeze(0)
            before = slots <= self.lens - 1 - window
            self.window_masks[window] = self.mask.masked_fill(before[:, None, None, :], float("-inf"))
        return self.window_masks[window]


def plan_decode_buckets(seq_lens: list[int], num_decodes: int) -> list[tuple[int, int]]:
    """Cut decodes [0, num_decodes), sorted by ascending seq_len, into (start, end) buckets of similar length."""
    buckets = []
    end = num_decodes
    while end > 0:
        longest = seq_lens[end - 1]
        start = end - 1
        while start > 0 and seq_lens[start - 1] >= longest * (1.0 - MAX_BUCKET_PAD_FRACTION):
            start -= 1
        buckets.append((start, end))
        end = start
    return buckets[::-1]


class CpuAttention(TorchAttention):
    """All decodes in a few torch length buckets, then prefill chunks one by one."""

    name = "cpu-torch"
    # The padded decode gathers read whole blocks, unwritten slots included (masked, but 0 * NaN garbage would
    # still poison the output): the cache starts zeroed.
    cache_needs_zeroing = True

    def __init__(self, meta: AttentionMetadata, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(meta, dtype)
        # Prefill requests without prior context attend to their fresh K/V; the rest gather their context.
        self.prefill_ids = range(meta.num_decodes, meta.num_reqs)
        self.buckets: list[DecodeBucket] = []
        bs, device = meta.block_size, meta.block_table.device
        for start, end in plan_decode_buckets(meta.seq_lens, meta.num_decodes):
            lens = torch.tensor(meta.seq_lens[start:end], device=device)
            nblk = -(-max(meta.seq_lens[start:end]) // bs)
            ids = meta.block_table[start:end, :nblk].reshape(-1)
            outside = torch.arange(nblk * bs, device=device).unsqueeze(0) >= lens.unsqueeze(1)
            mask = torch.zeros(outside.shape, dtype=dtype, device=device).masked_fill_(outside, float("-inf"))
            self.buckets.append(DecodeBucket(start, end, ids, nblk, mask[:, None, None, :], lens.unsqueeze(1)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float,
               window: int) -> torch.Tensor:
        meta = self.meta
        out = torch.empty_like(q)
        num_heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        group = num_heads // kv_heads
        for b in self.buckets:
            n = b.end - b.start
            ctx = b.num_blocks * meta.block_size
            if b.k_buf is None:  # fresh large buffers page-fault on first touch: pay that once per step
                b.k_buf = kv_cache.new_empty(b.flat_block_ids.shape[0], *kv_cache.shape[2:])
                b.v_buf = torch.empty_like(b.k_buf)
            torch.index_select(kv_cache[0], 0, b.flat_block_ids, out=b.k_buf)
            torch.index_select(kv_cache[1], 0, b.flat_block_ids, out=b.v_buf)
            kb = b.k_buf.view(n, ctx, kv_heads, head_dim).transpose(1, 2)
            vb = b.v_buf.view(n, ctx, kv_heads, head_dim).transpose(1, 2)
            # GQA without repeating K/V: the `group` query heads sharing a KV head act as `group` query rows.
            qb = q[b.start:b.end].reshape(n, kv_heads, group, head_dim)
            ob = sdpa(qb, kb, vb, attn_mask=b.mask_for(window), scale=scale)
            out[b.start:b.end] = ob.reshape(n, num_heads, head_dim)
        for i in self.prefill_ids:
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            if meta.num_computed[i] == 0:
                out[start:end] = attend_with_context(q[start:end], k[start:end], v[start:end], 0, scale, window)
                continue
            ctx_k, ctx_v = gather_context(kv_cache, meta.block_table[i], meta.seq_lens[i])
            out[start:end] = attend_with_context(q[start:end], ctx_k, ctx_v, meta.num_computed[i], scale, window)
        return out
