"""GGUF tensors' stored blocks read into ``layers.quantized``'s natural form (``from_gguf``), for every type the
integer kernels run (``GGUF_KERNEL_TYPES``); the packed layouts are ``QuantizedTensor.pack``'s."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from conveyor.layers import kquants
from conveyor.layers.quantized import QuantizedTensor, natural

GGUF_KERNEL_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 at byte ``at`` of every block, as float32 [n_blocks]."""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per 32-value block (low nibbles: values 0-15, high: 16-31) -> [n, 32] uint8."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes per block, bit i = the 5th bit of value i -> [n, 32] uint8 (0 or 16)."""
    return (np.unpackbits(qh, axis=-1, bitorder="little") << 4).astype(np.uint8)


def from_gguf(raw: np.ndarray, qtype_name: str, shape: tuple[int, int]) -> QuantizedTensor | None:
    """A GGUF tensor's stored bytes -> its ``QuantizedTensor``, or None for a type without a kernel (the caller
    dequantizes those). ``shape`` is [rows, cols] (numpy order)."""
    if qtype_name not in GGUF_KERNEL_TYPES or len(shape) != 2:
        return None
    n, k = shape
    if qtype_name in ("Q4_K", "Q5_K"):
        return _from_kquant(raw, qtype_name, n, k)
    if qtype_name == "Q6_K":
        if k % kquants.SUPER:  # not a layout llama.cpp writes (its rows hold whole super-blocks)
            return None
        q, scale, sup = kquants.natural(raw, n, k)
        t = torch.from_numpy
        return QuantizedTensor("q6", t(np.ascontiguousarray(q)), t(scale), t(-kquants.MID * scale), qtype_name, t(sup))
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}[qtype_name]
    blocks = raw.reshape(-1, size)
    d = _f16(blocks, 0).reshape(n, -1)
    if qtype_name == "Q8_0":
        return natural(blocks[:, 2:].view(np.int8).reshape(n, k), d, None, True, "q8", qtype_name)
    if qtype_name == "Q4_0":  # d * (q - 8)
        return natural(_nibbles(blocks[:, 2:]).reshape(n, k), d, -8 * d, False, "q4", qtype_name)
    if qtype_name == "Q4_1":  # d * q + m
        return natural(_nibbles(blocks[:, 4:]).reshape(n, k), d, _f16(blocks, 2).reshape(n, -1), False, "q4",
                        qtype_name)
    if qtype_name == "Q5_0":  # d * (q - 16), q 5-bit
        q = _nibbles(blocks[:, 6:]) | _high_bits(blocks[:, 2:6])
        return natural(q.reshape(n, k), d, -16 * d, False, "q5", qtype_name)
    q = _nibbles(blocks[:, 8:]) | _high_bits(blocks[:, 4:8])  # Q5_1: d * q + m
    return natural(q.reshape(n, k), d, _f16(blocks, 2).reshape(n, -1), False, "q5", qtype_name)


def _from_kquant(raw: np.ndarray, qtype_name: str, n: int, k: int) -> QuantizedTensor:
    """Q4_K / Q5_K super-blocks of 256: value = d * sc_j * q - dmin * m_j for sub-block j of 32 (the 6-bit scales
    and minimums unpacked by the gguf package's own ``Q4_K.get_scale_min``)."""
    from gguf.quants import Q4_K

    size = 144 if qtype_name == "Q4_K" else 176
    blocks = raw.reshape(-1, size)
    nsb = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    scale = (d[:, None] * sc.astype(np.float32)).reshape(n, -1)
    offset = (-dmin[:, None] * m.astype(np.float32)).reshape(n, -1)
    # d and dmin per row's super-block (none where a row does not hold whole super-blocks: scales go float32)
    sup = torch.from_numpy(np.stack([d, dmin], -1).reshape(n, -1, 2)) if k % 256 == 0 else None
    qs = blocks[:, size - 128:].reshape(nsb, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(nsb, 256)  # sub-blocks 2i, 2i + 1 per 32 bytes
    if qtype_name == "Q4_K":
        return replace(natural(low.reshape(n, k), scale, offset, False, "q4", qtype_name), super_scale=sup)
    qh = blocks[:, 16:48].reshape(nsb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = low | ((qh & 1) << 4).reshape(nsb, 256)
    return replace(natural(q.reshape(n, k), scale, offset, False, "q5", qtype_name), super_scale=sup)
