"""The native bidirectional attention over a step's packed sequences (csrc/encoder_attention.cpp,
``cvk_encoder_attention``) behind a typed call on torch tensors; ``CpuKernels.encoder`` is one of these."""

from __future__ import annotations

import ctypes

import torch

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM = 256  # csrc/encoder_attention.cpp's kMaxD


class EncoderAttnArgs(ctypes.Structure):
    """csrc/cvk.h's CvkEncoderAttnArgs (what each field holds is written there); checked against the library on
    load."""

    _fields_ = [("q", _P), ("k", _P), ("v", _P), ("out", _P), ("cu_seqlens", _P), ("q_stride", _I64),
                ("k_stride", _I64), ("v_stride", _I64), ("out_stride", _I64), ("dtype", _I32), ("num_seqs", _I32),
                ("H", _I32), ("KVH", _I32), ("D", _I32), ("num_threads", _I32), ("scale", _F32)]


class EncoderAttentionKernels:
    """``cvk_encoder_attention`` of one loaded library."""

    def __init__(self, lib: ctypes.CDLL, check) -> None:
        self._check = check
        self._run = lib.cvk_encoder_attention
        self._run.restype = ctypes.c_int
        self._run.argtypes = [ctypes.POINTER(EncoderAttnArgs)]

    @staticmethod
    def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether the kernel computes this layout: float32 or bfloat16, a head size that is a multiple of 16 up to
        256 (BERT-base/large 64, MiniLM 32), query heads a multiple of the key/value heads."""
        return (dtype in _DTYPE_CODES and 0 < head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0
                and num_kv_heads > 0 and num_heads % num_kv_heads == 0)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, cu_seqlens: torch.Tensor,
            scale: float) -> None:
        """out[rows of sequence s] = softmax(q k^T * scale) v within sequence s, for every s at once: sequence s
        owns rows [cu_seqlens[s], cu_seqlens[s + 1]) (int64 [S + 1] contiguous, starting at 0, as flash-attention's
        varlen ``cu_seqlens``), each query attends to every key of its own sequence (no causal mask).

        q and out [T, H, D], k and v [T, KVH, D], one dtype, each with unit strides inside a row (views of one fused
        qkv buffer are fine); rows after cu_seqlens[-1] are neither read nor written."""
        num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k.shape[1]
        for t in (q, k, v, out):
            if t.dtype != q.dtype or t.stride(2) != 1 or t.stride(1) != head_dim:
                raise ValueError(f"encoder attention: rows of one dtype, dense [heads, head_dim], got {t.dtype} "
                                 f"strides {t.stride()}")
        if cu_seqlens.dtype != torch.int64 or not cu_seqlens.is_contiguous():
            raise ValueError("encoder attention: cu_seqlens must be contiguous int64")
        if cu_seqlens.numel() and int(cu_seqlens[-1]) > min(q.shape[0], k.shape[0], v.shape[0], out.shape[0]):
            raise ValueError(f"encoder attention: cu_seqlens ends at {int(cu_seqlens[-1])}, past the rows given")
        a = EncoderAttnArgs(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(),
                            cu_seqlens=cu_seqlens.data_ptr(), q_stride=q.stride(0), k_stride=k.stride(0),
                            v_stride=v.stride(0), out_stride=out.stride(0), dtype=_DTYPE_CODES[q.dtype],
                            num_seqs=max(cu_seqlens.numel() - 1, 0), H=num_heads, KVH=num_kv_heads, D=head_dim,
                            num_threads=torch.get_num_threads(), scale=scale)
        self._check(f"cvk_encoder_attention (H={num_heads} KVH={num_kv_heads} D={head_dim})",
                    self._run(ctypes.byref(a)))
