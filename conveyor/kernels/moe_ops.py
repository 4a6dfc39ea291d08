"""The native routed MLP of a mixture of experts (csrc/moe.cpp, ``cvk_moe``) behind a typed call on torch tensors;
``CpuKernels.moe`` is one of these."""

from __future__ import annotations

import ctypes

import torch

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MOE_FLOAT, MOE_QUANT = 0, 1  # csrc/cvk.h's CVK_MOE_FLOAT, CVK_MOE_QUANT: how an expert's weight is held


class MoeArgs(ctypes.Structure):
    """csrc/cvk.h's CvkMoeArgs (what each field holds is written there); checked against the library on load."""

    _fields_ = [("x", _P), ("out", _P), ("logits", _P), ("experts", _P), ("scratch", _P), ("T", _I64),
                ("x_stride", _I64), ("hidden", _I64), ("inter", _I64), ("scratch_bytes", _I64), ("dtype", _I32),
                ("E", _I32), ("top_k", _I32), ("norm_topk_prob", _I32), ("num_threads", _I32)]


class MoeKernels:
    """``cvk_moe`` and its scratch size, of one loaded library."""

    def __init__(self, lib: ctypes.CDLL, check) -> None:
        self._check = check
        self._moe = lib.cvk_moe
        self._moe.restype = ctypes.c_int
        self._moe.argtypes = [ctypes.POINTER(MoeArgs)]
        self._scratch = lib.cvk_moe_scratch_bytes
        self._scratch.restype = _I64
        self._scratch.argtypes = [_I64, _I64, _I64, ctypes.c_int, ctypes.c_int, ctypes.c_int]

    def scratch_bytes(self, rows: int, hidden: int, inter: int, num_experts: int, top_k: int,
                      dtype: torch.dtype) -> int:
        """Scratch bytes ``run`` needs for a step of ``rows`` rows (with the AMX-INT8 setting now in force)."""
        return self._scratch(rows, hidden, inter, num_experts, top_k, _DTYPE_CODES[dtype])

    def run(self, x: torch.Tensor, logits: torch.Tensor, experts: torch.Tensor, out: torch.Tensor, inter: int,
            top_k: int, norm_topk_prob: bool, scratch: torch.Tensor | None = None) -> None:
        """out [T, hidden] = the routed MLP of x [T, hidden] (unit-strided rows) for router ``logits`` [T, E]
        float32 (contiguous) and the experts' table ``experts`` int64 [E, 4] (csrc/cvk.h's CvkMoeArgs)."""
        rows, hidden = x.shape
        num_experts = logits.shape[1]
        need = self.scratch_bytes(rows, hidden, inter, num_experts, top_k, x.dtype)
        if scratch is None or scratch.numel() < need:
            scratch = torch.empty(need, dtype=torch.uint8)
        a = MoeArgs(x=x.data_ptr(), out=out.data_ptr(), logits=logits.data_ptr(), experts=experts.data_ptr(),
                    scratch=scratch.data_ptr(), T=rows, x_stride=x.stride(0), hidden=hidden, inter=inter,
                    scratch_bytes=scratch.numel(), dtype=_DTYPE_CODES[x.dtype], E=num_experts, top_k=top_k,
                    norm_topk_prob=int(norm_topk_prob), num_threads=torch.get_num_threads())
        self._check(f"cvk_moe (E={num_experts} top_k={top_k})", self._moe(ctypes.byref(a)))
