"""How one layer's paged KV cache holds K and V: a backend declares its layout (``AttentionBackendType.kv_layout``),
and whoever reads the cache outside the backend's own kernels (the runner's hand-over copies, the key-mass pass of
KV eviction) goes through it, never through a guess from the cache's shape.

Two layouts exist. ``TOKEN_MAJOR`` ([2 (K, V), blocks, block_size, KV heads, head dim]) is the torch backends':
a block's slots are rows a gather takes whole. ``HEAD_MAJOR`` ([2, blocks, KV heads, block_size, head dim]) is the
native CPU kernels': one head's keys of a block are contiguous, the rows their dot products stream.
"""

from __future__ import annotations

import torch


class KVLayout:
    """The axis order inside a cache block, and the few views and copies that depend on it."""

    def __init__(self, name: str, head_major: bool) -> None:
        self.name, self.head_major = name, head_major

    def shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's cache (K and V of every block)."""
        block = (num_kv_heads, block_size) if self.head_major else (block_size, num_kv_heads)
        return (2, num_blocks, *block, head_dim)

    def heads_first(self, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks ``[..., <a block>]`` as ``[..., KV heads, block_size, head dim]`` (a view)."""
        return blocks if self.head_major else blocks.transpose(-2, -3)

    def heads_and_dim(self, cache: torch.Tensor) -> tuple[int, int]:
        """(KV heads, head dim) of a cache in this layout."""
        return cache.shape[2 if self.head_major else 3], cache.shape[4]

    def slots(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """K and V of the slots (``blocks[t]``, ``offsets[t]``): [2, T, KV heads, head dim] (a copy)."""
        if self.head_major:  # advanced indices around a slice: the indexed dim comes first -> [T, 2, heads, d]
            return cache[:, blocks, :, offsets, :].transpose(0, 1)
        return cache[:, blocks, offsets]

    def write_slots(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv`` [2, T, KV heads, head dim] in the slots (``blocks[t]``, ``offsets[t]``)."""
        if self.head_major:
            cache[:, blocks, :, offsets, :] = kv.transpose(0, 1)
        else:
            cache[:, blocks, offsets] = kv

    def keys(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """K of whole blocks, [..., KV heads, num_blocks * block_size, head dim], for ``block_ids`` [..., nb]."""
        return self.heads_first(cache[0][block_ids]).transpose(-3, -4).flatten(-3, -2)


TOKEN_MAJOR = KVLayout("token-major", head_major=False)
HEAD_MAJOR = KVLayout("head-major", head_major=True)
