"""Activations, including the fused-projection form used by gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the output of a fused gate_up projection: silu(gate) * up, halves along the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's "gelu_new": the tanh approximation of GELU."""
    return F.gelu(x, approximate="tanh")
