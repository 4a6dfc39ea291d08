"""A mixture's routed MLP on the native kernels (``kernels/csrc/moe.cpp``): routing, grouping by expert and every
chosen expert's two GEMMs in one native call per layer, instead of a handful of torch ops per expert.

``NativeExperts.build(moe, kernels)`` holds the experts' weights as the kernel's table (each expert's gate_up and
down: a quantized weight's descriptor, or a float32 linear's skinny-GEMM copy) once the linears are packed
(``models.cpu_layout``), or gives None where some expert cannot run there (a bias, a float weight in bfloat16, a
linear without its native packing). ``accepts(x)`` says per step: up to the rows every expert's GEMM runs natively
(``QuantLinear.max_rows``, ``PackedLinear.max_rows``), as the dense linears decide it; above (long prefill chunks)
the torch loop runs the same experts through their modules. The native layer stack reads the same table.
"""

from __future__ import annotations

import ctypes

import torch

from conveyor.kernels.moe_ops import MOE_FLOAT, MOE_QUANT
from conveyor.layers.linear import PackedLinear
from conveyor.layers.quantized import QuantLinear


def _weight(linear, dtype: torch.dtype) -> tuple[int, int, int] | None:
    """(address, kind, max rows) of one expert linear for the kernel, or None when it cannot run there."""
    if linear.bias is not None:
        return None
    if isinstance(linear, QuantLinear):
        return ctypes.addressof(linear.desc), MOE_QUANT, linear.max_rows
    if isinstance(linear, PackedLinear) and linear.skinny is not None and dtype == torch.float32:
        return linear.skinny.data_ptr(), MOE_FLOAT, linear.max_rows
    return None


class NativeExperts:
    """The native routed MLP of one ``models.moe.SparseMoE`` (module doc); holds pointers into the experts'
    tensors, so the module must outlive it (it is the module's attribute)."""

    def __init__(self, table: torch.Tensor, kernels, max_rows: int, dtype: torch.dtype, inter: int, top_k: int,
                 norm_topk_prob: bool) -> None:
        self.table, self.kernels, self.max_rows, self.dtype = table, kernels, max_rows, dtype
        self.inter, self.top_k, self.norm_topk_prob = inter, top_k, norm_topk_prob

    @classmethod
    def build(cls, moe, kernels) -> NativeExperts | None:
        dtype = moe.gate.weight.dtype
        if kernels is None or not kernels.supports(dtype):
            return None
        rows, max_rows = [], 1 << 30
        for expert in moe.experts:
            parts = [_weight(expert.gate_up_proj, dtype), _weight(expert.down_proj, dtype)]
            if None in parts:
                return None
            rows.append([v for address, kind, _ in parts for v in (address, kind)])
            max_rows = min([max_rows] + [limit for *_, limit in parts])
        table = torch.tensor(rows, dtype=torch.int64)
        inter = moe.experts[0].down_proj.in_features
        return cls(table, kernels, max_rows, dtype, inter, moe.top_k, moe.norm_topk_prob)

    def accepts(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype == self.dtype and 0 < x.shape[0] <= self.max_rows and x.stride(1) == 1

    def run(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The routed MLP of x [T, hidden] for its router logits [T, E]."""
        out = torch.empty(x.shape, dtype=x.dtype)
        self.kernels.moe.run(x, logits.to(torch.float32).contiguous(), self.table, out, self.inter, self.top_k,
                             self.norm_topk_prob)
        return out
