"""W8A8 linear layers (``--quantization w8a8``): int8 weights with one scale per output channel, as vLLM's W8A8
checkpoints hold them (``layers.quantized.int8_per_channel``), against activations quantized to int8 per row
(token) when the layer runs, as vLLM's dynamic per-token scheme computes them: one integer product per weight,
summed over the whole K in int32, then ``y = float(sum) * (w_scale[n] * x_scale[m]) + bias[n]``.

(``--quantization int8`` runs the same weights with 15-bit activations per block of 32, two 8-bit digits: twice the
integer work, closer to the float model; docs/kernels.md compares the two.)

Two paths, the same integers and the same epilogue function (csrc/gemm_w8a8.cpp), picked by row count:
up to ``W8A8_NATIVE_MAX_ROWS`` rows the native loop (``cvk_quant_gemm`` on a ``CVK_W8A8`` descriptor: the
activations quantized, VPDPBUSD over 16 columns x 8 rows at a time, the epilogue, in one parallel region; what the
native layer stack runs for decode steps); above, one native pass quantizes the activations, oneDNN's s8s8s32
GEMM (``torch._int_mm``) multiplies them, and one native pass applies the scales and the bias. The AVX2 level has
no native loop (``CpuKernels.w8a8.native`` is False): every row count takes the oneDNN path there, which picks its
own instructions, so nothing runs an instruction the CPU lacks.
"""

from __future__ import annotations

import torch

from conveyor.layers.quantized import BLOCK, GROUP, PackedQuantWeight, QuantLinear, int8_per_channel

# Rows up to which the native loop runs (where the build has it); above, torch._int_mm (oneDNN s8s8s32) between
# the native quantize and epilogue passes. benchmarks/gemm_quant.py --format w8a8 (docs/kernels.md, "W8A8"; Zen 5):
# the loop took 0.66-0.89x oneDNN's time from 32 to 512 rows in float32 (0.39x at 512 in bfloat16), so every row
# count takes it; oneDNN serves the AVX2 level, which has no loop.
W8A8_NATIVE_MAX_ROWS = 1 << 30


def pack_w8a8(q: torch.Tensor, scale: torch.Tensor) -> PackedQuantWeight:
    """q int8 [N, K] (values in [-127, 127]) and scale float32 [N] or [N, 1] -> the kernels' ``CVK_W8A8`` layout
    (csrc/cvk.h): q + 128 as ``CVK_Q8`` lays its bytes (groups of 16 columns, 16 columns x 4 k per 64 bytes), the
    scales padded with zeros to whole groups."""
    n, k = q.shape
    np_, kp = -(-n // GROUP) * GROUP, -(-k // BLOCK) * BLOCK
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    u = torch.nn.functional.pad(u, (0, kp - k, 0, np_ - n), value=128)  # padding: q = 0
    qs = u.view(np_ // GROUP, GROUP, kp // BLOCK, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(-1)
    s = torch.nn.functional.pad(scale.reshape(n).to(torch.float32), (0, np_ - n)).contiguous()
    return PackedQuantWeight("w8a8", qs, s, None, (n, k), "w8a8")


class W8A8Linear(QuantLinear):
    """y = x @ W.T + b for a W8A8 weight (module doc): ``q`` int8 [N, K], ``scale`` [N] (or [N, 1]) float32."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kernels,
                 dtype: torch.dtype) -> None:
        super().__init__(pack_w8a8(q, scale), bias, kernels, dtype)
        self.w_scale = self.quant.scale
        self.max_rows = W8A8_NATIVE_MAX_ROWS if kernels.w8a8.native else 0
        # [K, N]: torch._int_mm's operand, a second copy of the weight's bytes: made when a row count first takes
        # the oneDNN path (at once where the build has no native loop), never where the loop takes every row count
        self._q_t: torch.Tensor | None = None if self.max_rows >= W8A8_NATIVE_MAX_ROWS else q.contiguous().t()

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernels, dtype: torch.dtype) -> W8A8Linear:
        """Quantize a float weight per output channel (``int8_per_channel``, what benchmarks/make_w8a8.py writes)."""
        q, s = int8_per_channel(weight)
        return cls(q, s, bias, kernels, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        out = torch.empty(m, self.out_features, dtype=x.dtype)
        if m <= self.max_rows:
            self.kernels.quant_linear(x2, self.desc, self.bias, out)
        else:
            xq, x_scale = self.kernels.w8a8.quantize(x2)
            acc = torch._int_mm(xq, self._int_mm_weight())
            self.kernels.w8a8.epilogue(acc, x_scale, self.w_scale, self.bias, out)
        return out.view(*lead, self.out_features)

    def _int_mm_weight(self) -> torch.Tensor:
        """The int8 weight as ``torch._int_mm`` takes it, [K, N] (a transposed view), unpacked from the kernels'
        layout (``pack_w8a8``'s inverse) the first time it is needed."""
        if self._q_t is None:
            n, k = self.quant.full_shape
            np_, kp = -(-n // GROUP) * GROUP, -(-k // BLOCK) * BLOCK
            u = self.quant.qs.view(np_ // GROUP, kp // BLOCK, 8, GROUP, 4).permute(0, 3, 1, 2, 4).reshape(np_, kp)
            self._q_t = (u[:n, :k].to(torch.int16) - 128).to(torch.int8).contiguous().t()
        return self._q_t
