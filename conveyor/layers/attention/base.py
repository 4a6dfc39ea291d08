"""The attention backend interface: what every layer calls, once per layer per step."""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """One step's attention, prepared once from that step's ``AttentionMetadata`` (in the constructor) and then
    called by every layer with its own cache."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                scale: float) -> torch.Tensor:
        """q [T, H, d] and k, v [T, KVH, d] for the step's new tokens; returns [T, H, d].

        First writes the K/V of every new token into ``kv_cache`` ([2, num_blocks, block_size, KVH, d]), then
        reads: a request may attend to keys another request wrote in this very step (a same-step prefix hit)."""
