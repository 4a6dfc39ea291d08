"""Activations, including the fused-projection form used by gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor, kernels=None) -> torch.Tensor:
    """SwiGLU on the output of a fused gate_up projection: silu(gate) * up, halves along the last dim.

    With native CPU ``kernels`` one pass writes the result; otherwise three torch ops."""
    if kernels is not None and kernels.supports(gate_up.dtype) and gate_up.dim() == 2 and gate_up.is_contiguous():
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
        kernels.silu_mul(gate_up, out)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's "gelu_new": the tanh approximation of GELU."""
    return F.gelu(x, approximate="tanh")
