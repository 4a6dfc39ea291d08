"""The native passes of W8A8 (csrc/gemm_w8a8.cpp) behind typed calls on torch tensors; ``CpuKernels.w8a8`` is one of
these. The GEMM itself is ``CpuKernels.quant_linear`` on a ``CVK_W8A8`` descriptor (where ``native`` is true) or
oneDNN's s8s8s32 ``torch._int_mm`` between ``quantize`` and ``epilogue`` (layers/w8a8.py picks by row count)."""

from __future__ import annotations

import ctypes

import torch

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class W8A8Kernels:
    """``cvk_w8a8_quantize`` / ``cvk_w8a8_epilogue`` of one loaded library, and whether its ``cvk_quant_gemm`` runs
    W8A8 weights (``native``: the AVX-512 levels, VPDPBUSD where the CPU has VNNI; False at AVX2)."""

    def __init__(self, lib: ctypes.CDLL, check) -> None:
        self._check = check
        self.native = lib.cvk_w8a8_native() == 1
        self._quantize = lib.cvk_w8a8_quantize
        self._quantize.restype = _I32
        self._quantize.argtypes = [_I32, _P, _I64, _I64, _I64, _P, _I64, _P, _I32]
        self._epilogue = lib.cvk_w8a8_epilogue
        self._epilogue.restype = _I32
        self._epilogue.argtypes = [_I32, _P, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _I32]

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] float32 or bfloat16 (unit-strided rows) -> (q int8 [M, K], scale float32 [M]): per row, scale =
        max |x| / 127 and q = round-half-even(x * 127 / max |x|) (a row of zeros: scale 0, q 0)."""
        if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in _DTYPE_CODES:
            raise ValueError("w8a8.quantize takes [M, K] float32 or bfloat16 rows with unit stride")
        m, k = x.shape
        q = torch.empty(m, k, dtype=torch.int8)
        scale = torch.empty(m, dtype=torch.float32)
        self._check("cvk_w8a8_quantize", self._quantize(_DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), m, k,
                                                        q.data_ptr(), k, scale.data_ptr(), torch.get_num_threads()))
        return q, scale

    def epilogue(self, acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor) -> None:
        """out [M, N] = float(acc) * (w_scale[n] * x_scale[m]) + bias[n], one FMA per value: acc int32 [M, N],
        x_scale float32 [M], w_scale float32 [>= N] contiguous; out (float32 or bfloat16) and bias of one dtype."""
        m, n = acc.shape
        if acc.dtype != torch.int32 or acc.stride(1) != 1 or out.stride(1) != 1 or out.shape != acc.shape:
            raise ValueError("w8a8.epilogue takes int32 [M, N] sums and an [M, N] output with unit-strided rows")
        if not (x_scale.is_contiguous() and w_scale.is_contiguous() and x_scale.numel() >= m and w_scale.numel() >= n):
            raise ValueError("w8a8.epilogue: x_scale [M] and w_scale [N] must be contiguous float32")
        if bias is not None and (bias.dtype != out.dtype or not bias.is_contiguous()):
            raise ValueError("w8a8.epilogue: bias must be contiguous, of the output's dtype")
        self._check("cvk_w8a8_epilogue", self._epilogue(
            _DTYPE_CODES[out.dtype], acc.data_ptr(), acc.stride(0), m, n, x_scale.data_ptr(), w_scale.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads()))
