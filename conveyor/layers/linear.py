"""Linear layers at the CPU's GEMM rate: weights reordered once at load into oneDNN's blocked layout.

``F.linear`` on CPU hands float32 to MKL with the weight as stored, and bfloat16 to oneDNN, which reorders the
weight on every call. oneDNN's prepacked path (``torch.ops.mkldnn._reorder_linear_weight`` once, then
``torch.ops.mkldnn._linear_pointwise``, as inductor's freezing pass uses them) skips both costs; measured on
this project's CPUs in ``benchmarks/gemm.py`` (README: "Linear layers").

oneDNN compiles (JITs) a kernel for every new input shape, a few milliseconds each, and caches a bounded
number of them. A server sees every row count from 1 to the token budget, so the rows are padded up to one of
a fixed set of sizes (``padded_rows``: at most 1/16 extra rows, 144 sizes up to 4096), which bounds the
kernels per layer shape and costs a few percent of compute at most.

``prepare_linears(model)`` swaps every ``nn.Linear`` for a ``PackedLinear``; float64 (tests) and a torch build
without the oneDNN ops keep ``F.linear`` on a column-major copy of the weight (faster for skinny MKL GEMMs).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def padded_rows(m: int) -> int:
    """The row count oneDNN runs for ``m`` rows: exact up to 32, then the next of 16 sizes per octave (at most
    1/16 extra rows; 144 sizes up to 4096, so every layer shape's kernels fit oneDNN's cache of 1024)."""
    if m <= 32:
        return m
    step = 1 << (m.bit_length() - 5)
    return -(-m // step) * step


@functools.lru_cache(maxsize=1)
def onednn_available() -> bool:
    """Whether this torch has the prepacked oneDNN linear ops and they run (checked once, on a tiny layer)."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 8), 1)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8), w, None, "none", [], "")
        return bool(torch.allclose(y, torch.full((1, 4), 8.0)))
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in the layout of the fastest kernel that runs here.

    ``weight`` stays a parameter of the right shape and dtype on the meta device (no memory), so FLOP and
    parameter counts still see it; the data lives in ``packed`` (oneDNN) or ``dense`` (torch fallback).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, use_onednn: bool) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)
        self.use_onednn = use_onednn
        if use_onednn:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 32)
            self.dense = None
        else:
            self.packed = None
            self.dense = weight.detach().t().contiguous().t()  # column-major: MKL's skinny GEMMs like it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_onednn:
            return F.linear(x, self.dense, self.bias)
        m = x.shape[0]
        rows = padded_rows(m)
        if rows != m:
            x = torch.cat([x, x.new_zeros(rows - m, x.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return y if rows == m else y[:m]

    def extra_repr(self) -> str:
        kind = "onednn" if self.use_onednn else "torch"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, {kind}"


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
    use = weight.device.type == "cpu" and weight.dtype in ONEDNN_DTYPES and onednn_available()
    return PackedLinear(weight, bias, use)


@torch.no_grad()
def prepare_linears(model: nn.Module) -> None:
    """Replace every ``nn.Linear`` of a CPU model with a ``PackedLinear``; give a tied-embedding model its own
    packed lm_head (the embedding keeps its row-major copy for the token lookup)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, pack_linear(child.weight, child.bias))
    if getattr(model, "lm_head", "absent") is None:
        model.lm_head = pack_linear(model.get_input_embeddings().weight)
