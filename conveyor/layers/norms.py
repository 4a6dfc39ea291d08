"""Normalisation layers. RMSNorm computes in float32 whatever the weights' dtype, as the references do.

``RMSNorm(x, residual)`` is the fused pre-norm step of a decoder layer: ``residual = x + residual`` then
``rmsnorm(residual)``, returned as ``(normed, residual)`` (vLLM's convention); with native CPU kernels
(``kernels``, set by ``models.cpu_layout.prepare_for_cpu``) that is one pass over memory instead of four ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernels = None  # conveyor.kernels.CpuKernels, or None: torch ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rmsnorm(x) * weight; with ``residual``: (rmsnorm(x + residual) * weight, x + residual)."""
        k = self.kernels
        if k is not None and k.supports(x.dtype) and x.dim() == 2 and x.stride(1) == 1:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            if residual is not None:
                k.add_rmsnorm(x, residual, self.weight, self.eps, out)  # residual updated in place
                return out, residual
            k.add_rmsnorm(x, None, self.weight, self.eps, out)
            return out
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
