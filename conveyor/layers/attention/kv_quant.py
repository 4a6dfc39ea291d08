"""The int8 KV cache's rows (``--kv-cache-dtype int8``), in torch: the element type and row width a cache is
allocated with, and the quantization the native kernels apply when they write a row (csrc/cvk.h, CVK_KV_INT8),
written here as the reference that tests hold the kernels to and that reads a cache outside them.

A row is one token's one head: D int8 values then their float32 scale (4 bytes), D + 4 bytes where the model's
dtype takes 2 D (bfloat16) or 4 D (float32). The row x is first rotated, y = H x with H the unnormalized
Walsh-Hadamard transform of each block of b = D & -D values (all 64 or 128 of a usual head), which spreads a key's
outlier channels over the whole block (QuaRot's rotation; q.k is unchanged when q is rotated alike, which is what
the kernels do). Then scale = max |y| / 127, q = round-half-even(y / scale), so every value keeps 8 bits of the
rotated row's range; a row of zeros stores scale 0. Reading is H (q * scale) / b in float32.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # a float32 scale after each row's values


def cache_dtype(model_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The cache tensor's element type: the model's, bfloat16 (a float32 model's values rounded as the kernels write
    them: half the bytes, llama.cpp's 16-bit cache), or int8 (the scale's bytes ride in the row)."""
    if kv_cache_dtype == "int8":
        return torch.int8
    return torch.bfloat16 if kv_cache_dtype == "bfloat16" else model_dtype


def row_width(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements of the cache's dtype per (token, head) row: D, or D values + the scale's 4 bytes for int8."""
    return head_dim + SCALE_BYTES if kv_cache_dtype == "int8" else head_dim


def row_bytes(head_dim: int, kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    """Bytes per (token, head) row, to size the cache from a memory budget."""
    element = torch.empty(0, dtype=cache_dtype(model_dtype, kv_cache_dtype)).element_size()
    return row_width(head_dim, kv_cache_dtype) * element


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] float32 times H: the unnormalized Walsh-Hadamard transform of each block of D & -D values, as the
    kernels compute it (butterflies of stride 1, 2, 4, ..., each value one float32 add or subtract), bit for bit.
    Its own inverse up to the block size: rotate(rotate(x)) == (D & -D) * x."""
    d = x.shape[-1]
    h = 1
    while h < d & -d:
        pairs = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        u, v = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([u + v, u - v], dim=-2).reshape(x.shape)
        h *= 2
    return x


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) as int8 rows [..., D + 4]: the rotated values, then the float32 scale's bytes."""
    y = rotate(x.float())
    scale = y.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(y / scale), torch.zeros_like(y)).clamp_(-128, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D + 4] back to float32 [..., D]: H (q * scale) / b."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return rotate(rows[..., :d].float() * scale) / float(d & -d)
