"""The attention backend interface: what a backend class declares, what every layer calls once per step, and what
the whole-model native call reads of a step.

Callers (the runner, the model, the native layer stack) learn everything backend-specific from these declared
members: none of them tests a backend's name or type, or probes a member with ``getattr``
(``tests/test_protocols.py`` checks that every member they use is declared here).
"""

from __future__ import annotations

from typing import Protocol

import torch

from conveyor.kernels.cpu_ops import KeyMass
from conveyor.layers.attention.kv_layout import KVLayout
from conveyor.layers.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """One step's attention, prepared once from that step's ``AttentionMetadata`` and then called by every layer
    with its own cache.

    ``fuses_rope``: ``forward`` rotates q and k itself (then the model passes them unrotated with ``rope=``, the
    float32 table of the step's positions). ``supports_layer_stack``: the whole-model native call
    (``models.native_stack``) can run the step with this object, which is then a ``LayerStackAttention``.
    """

    name: str
    fuses_rope: bool
    supports_layer_stack: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float,
                rope: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        """q [T, H, d] and k, v [T, KVH, d] for the step's new tokens; returns [T, H, d].

        First writes the K/V of every new token into ``kv_cache`` (in the backend's ``kv_layout``), then reads: a
        request may attend to keys another request wrote in this very step (a same-step prefix hit). ``rope`` is
        given only to a backend that ``fuses_rope`` (which may also be called with ``rope=None`` and q, k
        rotated). ``window`` > 0 is the calling layer's sliding window: a query at slot p sees keys
        p - window + 1 .. p (transformers' and llama.cpp's definition); 0: every earlier key."""


class LayerStackAttention(AttentionBackend, Protocol):
    """A step's attention as the whole-model native call reads it (``models.native_stack``), when its
    ``supports_layer_stack``: the int64 metadata tensors and the kernels' work plan that every layer shares, the
    key-mass buffer of KV eviction by score, and the RoPE offsets of slots eviction shifted."""

    block_table: torch.Tensor  # [requests, max blocks] int64
    query_start: torch.Tensor  # [requests + 1] int64
    seq_lens: torch.Tensor  # [requests] int64
    rope_offset: torch.Tensor | None  # [requests] int64: position minus KV slot; None when no slot is shifted

    def plan(self, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor | None:
        """The step's attention work plan for this head layout (built once, shared by every layer)."""

    def mass_buffer(self, num_kv_heads: int) -> KeyMass | None:
        """The step's key-mass accumulator (KV eviction by score), or None when nothing is scored."""


class AttentionBackendType(Protocol):
    """A backend class: its declarations, read before any step (``layers.attention.backend_class``), and its one
    constructor.

    ``kv_layout`` says how each layer's cache is shaped and read (the runner allocates through it, the hand-over
    and the key-mass pass read through it); ``cache_needs_zeroing``, whether the runner must zero the caches;
    ``evicts_in_kernel``, whether its kernels score keys and rotate eviction's shifted slots themselves (else a
    step under KV eviction is wrapped in ``KeyMassAttention`` and the model rotates by position);
    ``kv_cache_dtypes``, the ``--kv-cache-dtype`` values its kernels read (``kv_quant``: int8 rows with scales);
    ``graph_capturable``, whether a CUDA graph may capture its step objects: built over ``AttentionMetadata``'s
    ``device_lens``, they launch the same kernels over the same addresses at every call (``runner.decode_graphs``).
    """

    name: str
    kv_layout: KVLayout
    kv_cache_dtypes: tuple[str, ...]
    cache_needs_zeroing: bool
    fuses_rope: bool
    supports_layer_stack: bool
    evicts_in_kernel: bool
    graph_capturable: bool

    def for_step(self, meta: AttentionMetadata, dtype: torch.dtype,
                 scored: dict[int, int] | None = None) -> AttentionBackend:
        """The step's attention object. ``scored`` (request index -> trailing query rows whose attention mass per
        block ``block_scores`` returns) is given only to a backend that ``evicts_in_kernel``."""


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
