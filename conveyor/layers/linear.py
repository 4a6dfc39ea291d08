"""Linear layers at the CPU's GEMM rate: weights reordered once at load into oneDNN's blocked layout.

``F.linear`` on CPU hands float32 to MKL with the weight as stored, and bfloat16 to oneDNN, which reorders the
weight on every call. oneDNN's prepacked path (``torch.ops.mkldnn._reorder_linear_weight`` once, then
``torch.ops.mkldnn._linear_pointwise``, as inductor's freezing pass uses them) skips both costs; measured on
this project's CPUs (docs/benchmarks.md).

oneDNN compiles (JITs) a kernel for every new input shape, a few milliseconds each, and caches a bounded
number of them. A server sees every row count from 1 to the token budget, so the rows are padded up to one of
a fixed set of sizes (``padded_rows``: at most 1/16 extra rows, 144 sizes up to 4096), which bounds the
kernels per layer shape and costs a few percent of compute at most.

At decode sizes a GEMM is bound by how fast its weight streams from memory, and oneDNN's kernels reach only
part of that: in float32 half, in bfloat16 on AMX about two thirds at 1-32 rows (measured: docs/benchmarks.md). There the
native kernels (conveyor/kernels) stream a second copy of the weight, packed in 16-column blocks, instead: up to
``SKINNY_MAX_ROWS`` rows in float32, up to ``AMX_MAX_ROWS`` rows in bfloat16 on CPUs with AMX, up to
``BF16_DOT_MAX_ROWS`` in bfloat16 on CPUs with AVX512_BF16 but no AMX (Zen 4/5: VDPBF16PS dot products)
(``benchmarks/gemm.py`` compares the two per row count). Float32 at 8-32 rows: 0.64-0.93x oneDNN's time; at 40-96
rows the GEMM alone is on par (0.85-1.16x over repeated runs on this drifting machine), and what decides the
limit is that those steps then run through the native layer stack (models/native_stack.py) whole: the bench
model's workload took 7.8% less on the best of 4 alternated rounds with 96 rows than with 32, and whole decode
steps of 100-128 rows took 7-33% less on the best of 8 (6-16% on the median; bench model and SmolLM2 float32,
SmolLM2 bfloat16 on AMX, alternated in one engine) with 128 than with 96. At 192-256 rows it ranged from 15% less
to 16% more, so the limit stops at 128 (which also bounds the packed-x scratch). Without AMX, bfloat16 on
VDPBF16PS outran oneDNN's GEMM at 1-128 rows on Zen 5 (in most runs of a loaded machine) and its layer stack's decode steps took 0.60-0.78x the
per-layer oneDNN path's time at batch 1-64 (docs/kernels.md), so its limit is 128 too; below the avx512bf16 level
(AVX2-only CPUs) bfloat16 stays on oneDNN.

``prepare_linears(model, kernels)`` swaps every ``nn.Linear`` for a ``PackedLinear``; float64 (tests) and a
torch build without the oneDNN ops keep ``F.linear`` on a column-major copy of the weight (faster for skinny
MKL GEMMs).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
SKINNY_MAX_ROWS = 128  # float32 batches up to this many rows take the native skinny GEMM (AVX-512 builds)
SKINNY_MAX_ROWS_AVX2 = 96  # the same on AVX2 builds (no k-blocked loop there; 128 not measured on such a CPU)
AMX_MAX_ROWS = 128  # bfloat16 batches up to this many rows take the native AMX GEMM where the CPU has AMX
# bfloat16 batches up to this many rows take the native VDPBF16PS GEMM on CPUs with AVX512_BF16 but no AMX
BF16_DOT_MAX_ROWS = 128


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

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, use_onednn: bool, kernels=None) -> None:
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
        # decode batches: a native kernel on its own copy of the weight (float32 anywhere; bfloat16 on AMX tiles,
        # or on VDPBF16PS dot products where the CPU has AVX512_BF16 but no AMX)
        self.kernels, self.skinny, self.max_rows, self.on_amx = None, None, 0, False
        if kernels is not None and weight.device.type == "cpu":
            if weight.dtype == torch.float32:
                self.max_rows = SKINNY_MAX_ROWS_AVX2 if kernels.level == "avx2" else SKINNY_MAX_ROWS
            elif weight.dtype == torch.bfloat16 and kernels.amx:
                self.on_amx = self.in_features % 32 == 0
                self.max_rows = AMX_MAX_ROWS if self.on_amx else 0
            elif weight.dtype == torch.bfloat16 and kernels.bf16_dot and self.in_features % 2 == 0:
                self.max_rows = BF16_DOT_MAX_ROWS
            if self.max_rows:
                self.kernels, self.skinny = kernels, kernels.pack_skinny_weight(weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m <= self.max_rows and x.dim() == 2 and x.stride(1) == 1:
            out = torch.empty(m, self.out_features, dtype=x.dtype, device=x.device)
            if self.on_amx:
                self.kernels.amx_linear(x, self.skinny, self.bias, self.out_features, out)
            else:
                self.kernels.skinny_linear(x, self.skinny, self.bias, self.out_features, out)
            return out
        if not self.use_onednn:
            return F.linear(x, self.dense, self.bias)
        rows = padded_rows(m)
        if rows != m:
            x = torch.cat([x, x.new_zeros(rows - m, x.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return y if rows == m else y[:m]

    def extra_repr(self) -> str:
        kind = ("onednn" if self.use_onednn else "torch") + ("+skinny" if self.skinny is not None else "")
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, {kind}"


def linear_gelu(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``gelu(linear(x))`` (exact erf GELU), in the GEMM's epilogue where oneDNN runs it (one pass over the
    output instead of two). ``x``'s rows should be a ``padded_rows`` count: the fused calls do not pad."""
    if _fusable(linear, x):
        return torch.ops.mkldnn._linear_pointwise(x, linear.packed, linear.bias, "gelu", [], "none")
    return F.gelu(linear(x))


def linear_add(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``linear(x) + residual``, the add in the GEMM's epilogue where oneDNN runs it (as ``linear_gelu``)."""
    if _fusable(linear, x) and residual.shape == (x.shape[0], linear.out_features) and residual.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, linear.packed, linear.bias, "add")
    return linear(x) + residual


def _fusable(linear: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``x`` would go to oneDNN's prepacked GEMM as it is (no native skinny kernel, no padding)."""
    m = x.shape[0]
    return (isinstance(linear, PackedLinear) and linear.use_onednn and m > linear.max_rows and x.dim() == 2
            and padded_rows(m) == m and x.is_contiguous())


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, kernels=None) -> PackedLinear:
    use = weight.device.type == "cpu" and weight.dtype in ONEDNN_DTYPES and onednn_available()
    return PackedLinear(weight, bias, use, kernels)


@torch.no_grad()
def prepare_linears(model: nn.Module, kernels=None) -> None:
    """Replace every ``nn.Linear`` of a CPU model with a ``PackedLinear`` (using the native ``kernels`` where they
    win, when given); give a tied-embedding model its own packed lm_head (the embedding keeps its row-major
    copy for the token lookup)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, pack_linear(child.weight, child.bias, kernels))
    if getattr(model, "lm_head", "absent") is None:
        model.lm_head = pack_linear(model.get_input_embeddings().weight, None, kernels)
