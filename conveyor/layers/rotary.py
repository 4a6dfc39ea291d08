"""Rotary position embedding (GPT-NeoX "rotate half" layout, as Llama / Qwen2 / Mistral use it).

The cos/sin table is built once for all positions; per step the model looks it up once for the batch's
positions and every layer reuses that lookup.
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with the rope scaling variants Llama-family checkpoints use."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, blend smoothly in between.
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (default, linear, llama3 are)")


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin for every position; ``lookup(positions)`` once per step, ``apply`` in every layer."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos_sin", self._table(dtype, device), persistent=False)

    def _table(self, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
        # Computed on the CPU in float64 whatever the default device (also while a model is built on the meta
        # device: the table is real data, not a parameter a checkpoint fills), then rounded once to ``dtype``.
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float64, device="cpu"), inv_freq)
        # [max_positions, 2, head_dim // 2]: cos and sin side by side, so one index_select fetches both.
        return torch.stack([angles.cos(), angles.sin()], dim=1).to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim // 2], broadcastable over heads."""
        cs = self.cos_sin.index_select(0, positions)
        return cs[:, 0].unsqueeze(1), cs[:, 1].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by its positions' angles (rotate-half layout); returns a new tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
