"""Copy a request's KV out of the paged cache and into another one (disaggregated prefill / decode).

The wire form is per token, not per block: ``[num_layers, 2 (K, V), num_tokens, num_kv_heads, head_dim]``,
contiguous, on the CPU. Per token because the two engines need not agree on the block size or on the attention
backend's layout (its declared ``kv_layout``: token-major for the torch backends, head-major for the native CPU
one): each side maps token t to its own slot ``block_ids[t // block_size] * block_size + t % block_size`` and
reads or writes it through its layout.
"""

from __future__ import annotations

import torch

from conveyor.layers.attention import KVLayout


def _slots(block_ids: list[int], num_tokens: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(num_tokens, device=device)
    blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)[t // block_size]
    return blocks, t % block_size


def gather_kv(kv_caches: list[torch.Tensor], block_ids: list[int], num_tokens: int, block_size: int,
              layout: KVLayout) -> torch.Tensor:
    """The K/V of the first ``num_tokens`` tokens held in ``block_ids``, every layer, in the wire form."""
    blocks, offsets = _slots(block_ids, num_tokens, block_size, kv_caches[0].device)
    return torch.stack([layout.slots(cache, blocks, offsets) for cache in kv_caches]).contiguous().cpu()


def scatter_kv(kv_caches: list[torch.Tensor], block_ids: list[int], kv: torch.Tensor, block_size: int,
               layout: KVLayout, skip_block: int | None = None) -> None:
    """Write wire-form ``kv`` (its tokens 0..T-1) into the slots of ``block_ids``, every layer; converts dtype
    and device. Tokens whose entry is ``skip_block`` (the null block of entries outside every sliding window,
    which must stay zero) are not written. Raises ValueError when the shapes say another model."""
    cache0 = kv_caches[0]
    if (kv.dtype == torch.int8) != (cache0.dtype == torch.int8):  # int8 rows carry their scales: no conversion
        raise ValueError(f"handed-over KV is {kv.dtype}, this cache {cache0.dtype}: the prefill and decode engines "
                         "need the same --kv-cache-dtype")
    heads, dim = layout.heads_and_dim(cache0)
    if kv.dim() != 5 or kv.shape[0] != len(kv_caches) or kv.shape[1] != 2 or tuple(kv.shape[3:]) != (heads, dim):
        raise ValueError(f"handed-over KV of shape {tuple(kv.shape)} does not fit this model's cache "
                         f"({len(kv_caches)} layers, {heads} KV heads of {dim})")
    num_tokens = kv.shape[2]
    if len(block_ids) * block_size < num_tokens:
        raise ValueError(f"{num_tokens} handed-over tokens do not fit in {len(block_ids)} blocks")
    blocks, offsets = _slots(block_ids, num_tokens, block_size, cache0.device)
    kv = kv.to(device=cache0.device, dtype=cache0.dtype)
    if skip_block is not None:
        kept = blocks != skip_block
        blocks, offsets, kv = blocks[kept], offsets[kept], kv[:, :, kept]
    for cache, layer in zip(kv_caches, kv):
        layout.write_slots(cache, blocks, offsets, layer)
