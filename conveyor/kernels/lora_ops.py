"""The native segmented LoRA kernel (csrc/lora.cpp, ``cvk_lora_apply``) behind a typed call on torch tensors;
``CpuKernels.lora`` is one of these."""

from __future__ import annotations

import ctypes

import torch

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class LoraArgs(ctypes.Structure):
    """csrc/cvk.h's CvkLoraArgs (what each field holds is written there); checked against the library on load."""

    _fields_ = [("x", _P), ("y", _P), ("a", _P), ("b", _P), ("rows", _P), ("seg_start", _P), ("seg_slot", _P),
                ("sub_cols", _P), ("scratch", _P), ("x_stride", _I64), ("y_stride", _I64), ("K", _I64), ("N", _I64),
                ("SR", _I64), ("R", _I64), ("num_segs", _I64), ("num_subs", _I64), ("dtype", _I32),
                ("num_threads", _I32), ("w_dtype", _I32)]


class LoraKernels:
    """``cvk_lora_apply`` of one loaded library."""

    dtypes = tuple(_DTYPE_CODES)

    def __init__(self, lib: ctypes.CDLL, check) -> None:
        self._check = check
        self._apply = lib.cvk_lora_apply
        self._apply.restype = ctypes.c_int
        self._apply.argtypes = [ctypes.POINTER(LoraArgs)]

    def apply(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
              seg_start: torch.Tensor, seg_slot: torch.Tensor, sub_cols: torch.Tensor, rank: int) -> None:
        """y[row] += (x[row] @ a[slot]) @ b[slot] for the rows of each segment, in place: x [T, K] and y [T, N] of
        one dtype with unit-strided rows; a [slots, K, SR], b [slots, SR, N] contiguous, both float32 or both
        bfloat16 (summed in float32 either way), SR = rank x parts; rows, seg_start [S + 1], seg_slot [S] and
        sub_cols [parts + 1] int64 contiguous (part p's columns of y read rank slice p of the shrink only)."""
        if x.stride(1) != 1 or y.stride(1) != 1 or x.dtype != y.dtype or x.dtype not in _DTYPE_CODES:
            raise ValueError("lora apply: x and y need unit-strided rows of one dtype (float32 or bfloat16)")
        if not (a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype and a.dtype in _DTYPE_CODES):
            raise ValueError("lora apply: the adapters' a and b must be contiguous, both float32 or both bfloat16")
        scratch = torch.empty(max(1, rows.shape[0]) * a.shape[2], dtype=torch.float32)
        args = self.segments(rows, seg_start, seg_slot, rank, a.dtype, scratch)
        args.x, args.y, args.a, args.b, args.sub_cols = x.data_ptr(), y.data_ptr(), a.data_ptr(), b.data_ptr(), \
            sub_cols.data_ptr()
        args.x_stride, args.y_stride, args.K, args.N = x.stride(0), y.stride(0), x.shape[1], y.shape[1]
        args.SR, args.num_subs, args.dtype = a.shape[2], sub_cols.shape[0] - 1, _DTYPE_CODES[x.dtype]
        self._check(f"cvk_lora_apply (K={x.shape[1]} N={y.shape[1]} SR={a.shape[2]})", self._apply(ctypes.byref(args)))

    @staticmethod
    def segments(rows: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor, rank: int,
                 weight_dtype: torch.dtype, scratch: torch.Tensor) -> LoraArgs:
        """The step's part of the arguments (its rows grouped by slot, the weights' dtype, float32 ``scratch`` of
        rows x SR values): ``apply`` adds one linear's, the layer stack (``cvk_llama_layers``' lora) each linear's."""
        return LoraArgs(rows=rows.data_ptr(), seg_start=seg_start.data_ptr(), seg_slot=seg_slot.data_ptr(),
                        scratch=scratch.data_ptr(), R=rank, num_segs=seg_slot.shape[0],
                        num_threads=torch.get_num_threads(), w_dtype=_DTYPE_CODES[weight_dtype])
