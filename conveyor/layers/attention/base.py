"""The attention backend interface: the KV layout a backend owns, and what every layer calls once per step.

Callers (the runner, the model, the native layer stack) learn everything backend-specific from these declared
attributes: none of them tests a backend's name or type.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """One step's attention, prepared once from that step's ``AttentionMetadata`` (in the constructor) and then
    called by every layer with its own cache.

    Class-level declarations (read before any step, from the class ``layers.attention.backend_class`` returns):
    ``kv_cache_shape`` and ``cache_needs_zeroing`` say how the runner allocates each layer's cache;
    ``fuses_rope`` says whether ``forward`` rotates q and k itself (then the model passes them unrotated with
    ``rope=``, the float32 table of the step's positions); ``supports_layer_stack`` says whether the whole-model
    native call (``models.native_stack``) can run a step with this object (it then reads the object's
    ``block_table``, ``query_start`` and ``seq_lens`` int64 tensors and its ``plan(...)``, the native kernels'
    work plan for the step).
    """

    name: str
    fuses_rope: bool
    cache_needs_zeroing: bool
    supports_layer_stack: bool

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's cache (K and V of every block)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float,
                rope: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        """q [T, H, d] and k, v [T, KVH, d] for the step's new tokens; returns [T, H, d].

        First writes the K/V of every new token into ``kv_cache`` (of ``kv_cache_shape``), then reads: a request
        may attend to keys another request wrote in this very step (a same-step prefix hit). ``rope`` is given
        only to a backend that ``fuses_rope`` (which may also be called with ``rope=None`` and q, k rotated).
        ``window`` > 0 is the calling layer's sliding window: a query at slot p sees keys p - window + 1 .. p
        (transformers' and llama.cpp's definition); 0: every earlier key."""


def token_major_kv_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]: the torch backends' layout, in which a block's
    slots are rows a gather can take whole."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def window_allows(q_slots: torch.Tensor, k_slots: torch.Tensor, window: int) -> torch.Tensor:
    """Causal (and, with ``window`` > 0, sliding-window) visibility [queries, keys] of keys at ``k_slots`` from
    queries at ``q_slots``: the one mask rule every torch path builds."""
    allowed = k_slots.unsqueeze(0) <= q_slots.unsqueeze(1)
    if window:
        allowed &= k_slots.unsqueeze(0) > q_slots.unsqueeze(1) - window
    return allowed


def reject_rope(backend: str, rope: torch.Tensor | None) -> None:
    """A backend that does not fuse RoPE must never be handed the table: q and k would go unrotated."""
    if rope is not None:
        raise ValueError(f"attention backend {backend!r} does not fuse RoPE; rotate q and k before forward")
