"""Pad rows for the static/dynamic baselines, run around whichever attention backend runs.

A static batch is a padded [batch, longest prompt] tensor: every row is computed, pads included. The runner
reproduces that cost by appending pad tokens after the step's real tokens; the whole model computes them (every
linear layer sees T + pad rows). Attention is the one place where they must be kept apart: they must not write
the KV cache or be seen by real queries, and must cost what padded rows cost. So the backend runs on the real
rows only, and the pad rows attend causally among themselves in segments no longer than the step's longest
prompt chunk (the rows of a padded tensor), never as one sequence whose attention would grow with the square of
*all* the padding. Backends know nothing of this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.layers.attention.base import AttentionBackend, reject_rope
from conveyor.layers.attention.common import causal_self_attention


@dataclass(frozen=True)
class Padding:
    """Pad rows of one step: ``num_tokens`` of them after the real tokens, in causal segments of ``segment``."""

    num_tokens: int
    segment: int

    def segments(self, start: int) -> list[tuple[int, int]]:
        """(first row, end row) of each segment, the pad rows starting at row ``start``."""
        end, step = start + self.num_tokens, max(self.segment, 1)
        return [(s, min(s + step, end)) for s in range(start, end, step)]


class PaddedAttention:
    """``inner`` on the first ``num_real`` rows; the pad rows after them attend within their own segments.

    The model rotates q and k itself here (the pad rows need rotating too, and ``inner`` sees only the real
    ones), and the whole-model native call does not take pad rows."""

    fuses_rope = False
    supports_layer_stack = False

    def __init__(self, inner: AttentionBackend, num_real: int, padding: Padding) -> None:
        self.inner = inner
        self.name = inner.name
        self.num_real = num_real
        self.padding = padding

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                scale: float, rope: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        reject_rope(f"padded {self.name}", rope)
        n = self.num_real
        out = torch.empty_like(q)
        out[:n] = self.inner.forward(q[:n], k[:n], v[:n], kv_cache, scale, window=window)
        for s, e in self.padding.segments(n):
            out[s:e] = causal_self_attention(q[s:e], k[s:e], v[s:e], scale, window)
        return out
