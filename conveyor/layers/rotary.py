"""Rotary position embedding (GPT-NeoX "rotate half" layout, as Llama / Qwen / Mistral / Gemma / Phi use it).

The cos/sin table is built once for all positions; per step the model looks it up once for the batch's
positions and every layer reuses that lookup. Scalings (linear, dynamic, YaRN, LongRoPE, Llama 3, GGUF frequency
factors) are ``layers.rope_scaling``'s; their attention factor multiplies cos and sin.

Partial rotary (Phi-4-mini rotates the first 3/4 of each head) runs on the same full-width kernels: the model
reorders each q/k head's rows at load (``partial_rotary_order``) so that every rotated pair (i, i + rotary_dim/2)
lands on (j, j + head_dim/2), and the table gives the unrotated pairs the angle 0 (cos 1, sin 0: x1 * 1 - x2 * 0
is x1 exactly). q.k is a sum over the head's dims, the same in any order, so attention is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.layers.rope_scaling import rope_inv_freq


def partial_rotary_order(head_dim: int, rotary_dim: int) -> list[int]:
    """The order of one head's q/k rows that puts rotary dims [0, rotary_dim) (pairs i, i + rotary_dim/2) on the
    full-width pairs (j, j + head_dim/2) for j < rotary_dim/2, and the unrotated dims on the rest."""
    r = rotary_dim // 2
    rest = (head_dim - rotary_dim) // 2
    return [*range(r), *range(rotary_dim, rotary_dim + rest), *range(r, rotary_dim), *range(rotary_dim + rest, head_dim)]


@dataclass
class RopeInputs:
    """One step's rotary inputs: cos, sin [T, 1, head_dim // 2] for ``apply_rotary``, or, for a backend that
    rotates inside its kernel (``fuses_rope``), the float32 table of every position ([positions, head_dim]:
    cos halves then sin halves)."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    table: torch.Tensor | None = None


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin for every position; ``lookup(positions)`` once per step, ``apply`` in every layer.

    ``rotary_dim`` (default ``head_dim``) rotates only that many dims, laid out by ``partial_rotary_order``;
    ``max_positions`` is the table's length, ``checkpoint_positions`` the checkpoint's ``max_position_embeddings``
    (the default of some scalings' parameters)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 rotary_dim: int | None = None, checkpoint_positions: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.rotary_dim = rotary_dim or head_dim
        self.checkpoint_positions = checkpoint_positions or max_positions
        self.register_buffer("cos_sin", self._table(dtype, device), persistent=False)
        self._float32_table: torch.Tensor | None = None  # not a buffer: model.to(bfloat16) must not round it

    def _table(self, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
        # Computed on the CPU in float64 whatever the default device (also while a model is built on the meta
        # device: the table is real data, not a parameter a checkpoint fills), then rounded once to ``dtype``.
        inv_freq, factor = rope_inv_freq(self.rotary_dim, self.theta, self.scaling, self.checkpoint_positions)
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float64, device="cpu"), inv_freq)
        cos, sin = angles.cos() * factor, angles.sin() * factor
        if self.rotary_dim < self.head_dim:  # unrotated pairs: angle 0, unscaled
            pad = (self.head_dim - self.rotary_dim) // 2
            cos = torch.cat([cos, torch.ones(self.max_positions, pad, dtype=torch.float64, device="cpu")], dim=1)
            sin = torch.cat([sin, torch.zeros(self.max_positions, pad, dtype=torch.float64, device="cpu")], dim=1)
        # [max_positions, 2, head_dim // 2]: cos and sin side by side, so one index_select fetches both.
        return torch.stack([cos, sin], dim=1).to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor, fused: bool = False) -> RopeInputs:
        """This step's rope inputs: cos and sin of ``positions``, or (``fused``) the float32 table."""
        if fused:
            if self._float32_table is None or self._float32_table.device != positions.device:
                self._float32_table = self._table(torch.float32, positions.device).flatten(1).contiguous()
            return RopeInputs(table=self._float32_table)
        cs = self.cos_sin.index_select(0, positions)
        return RopeInputs(cos=cs[:, 0].unsqueeze(1), sin=cs[:, 1].unsqueeze(1))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by its positions' angles (rotate-half layout); returns a new tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
