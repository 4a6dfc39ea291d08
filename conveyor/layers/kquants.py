"""GGUF's K-quants for the integer kernels, as ``layers.quantized`` holds them: Q6_K read into natural order and
packed into csrc/cvk.h's ``CVK_Q6`` layout, and Q4_K / Q5_K's scales packed as the file holds them
(``CVK_SCALE_KQUANT``: a byte per sub-scale and minimum, the f16 d and dmin per 256 values).

A Q6_K super-block of 256 values is ``ql`` (128 bytes: low 4 bits), ``qh`` (64: high 2 bits), 16 int8 sub-scales
and one f16 ``d``: value = d * sub_j * (q - 32) for sub-block j of 16, q 6-bit. The packed form keeps exactly that
(q's 6 bits, the int8 sub-scales, the f16 ``d`` per 256 values per column: 0.8203 bytes a value, the file's), in
the kernels' order: columns in groups of 16, 32 k a block; per block 256 bytes of low nibbles laid as ``CVK_Q4``
lays 4-bit q, then 128 bytes of high bit pairs.
"""

from __future__ import annotations

import numpy as np
import torch

SUPER = 256  # values per super-block (one d)
SUB = 16  # values per sub-block (one int8 scale)
MID = 32  # q's middle: value = scale * (q - 32)


def natural(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q6_K [n, k] tensor's bytes -> (q uint8 [n, k] in 0..63, scale float32 [n, k / 16] = d * sub (exact in
    float32: an f16 times an int8), d float32 [n, k / 256]), unpacked as the gguf package's ``Q6_K`` does."""
    blocks = raw.reshape(-1, 210)
    nsb = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sub = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)  # [nsb, 1]
    low = (ql.reshape(nsb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = low.reshape(nsb, 256) | (high.reshape(nsb, 256) << 4)
    return q.reshape(n, k), (d * sub).reshape(n, k // SUB), d.reshape(n, k // SUPER)


def pack(q: torch.Tensor, scale: torch.Tensor, super_scale: torch.Tensor, group: int, block: int):
    """q uint8 [N, K], scale float32 [N, K / 16] (= super x an int8), super_scale float32 [N, K / 256] (halves)
    -> (qs uint8, sub int8 [NP / 16, K / 16, 16], super float16 [NP / 16, K / 256, 16]) in cvk.h's ``CVK_Q6``
    layout, rows padded with zeros to a multiple of ``group``. A scale that is not its super-scale times an int8
    is an error (the packed form could not hold it)."""
    n, k = q.shape
    if k % SUPER:
        raise ValueError(f"a Q6_K weight's in_features must be a multiple of {SUPER}, not {k}")
    rep = super_scale.repeat_interleave(SUPER // SUB, dim=1)
    sub = torch.where(rep != 0, torch.round(scale / torch.where(rep != 0, rep, 1.0)), 0.0)
    half = super_scale.to(torch.float16)
    if (not torch.equal(half.to(torch.float32), super_scale) or not torch.equal(sub * rep, scale)
            or sub.min().item() < -128 or sub.max().item() > 127):
        raise ValueError("the Q6_K scales are not an f16 super-scale times int8 sub-scales")
    np_ = -(-n // group) * group
    groups, nb = np_ // group, k // block
    qp = torch.nn.functional.pad(q, (0, 0, 0, np_ - n))
    # low nibbles as CVK_Q4: [g, i, j, u, half, b] -> byte (g, j, u, i, b) = low | high << 4
    v = (qp & 0x0F).view(groups, group, nb, 4, 2, 4)
    low = (v[:, :, :, :, 0] | (v[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(groups, nb, 256)
    # high bit pairs: [g, i, j, v, t, b] -> byte (g, j, v, i, b) holding quad 4v + t's at bits 2t
    h = (qp >> 4).view(groups, group, nb, 2, 4, 4)
    high = h[:, :, :, :, 0] | (h[:, :, :, :, 1] << 2) | (h[:, :, :, :, 2] << 4) | (h[:, :, :, :, 3] << 6)
    high = high.permute(0, 2, 3, 1, 4).reshape(groups, nb, 128)
    qs = torch.cat([low, high], dim=2).contiguous().view(-1)

    def grouped(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = torch.nn.functional.pad(t, (0, 0, 0, np_ - n))
        return t.view(groups, group, -1).transpose(1, 2).to(dtype).contiguous()

    return qs, grouped(sub, torch.int8), grouped(super_scale, torch.float16)


def pack_scales(scale: torch.Tensor, offset: torch.Tensor, super_scale: torch.Tensor, group: int, block: int):
    """Q4_K / Q5_K: scale, offset float32 [N, K / 32] (= d * sc and -dmin * m), super_scale float32 [N, K / 256, 2]
    (d, dmin) -> (sc uint8 [NP / 16, K / 32, 16], m likewise, super float16 [NP / 16, K / 256, 2, 16]) in cvk.h's
    ``CVK_SCALE_KQUANT`` layout, rows padded with zeros. Scales that are not so are an error."""
    n, nb = scale.shape
    per = SUPER // block
    d = super_scale[:, :, 0].repeat_interleave(per, dim=1)
    dmin = super_scale[:, :, 1].repeat_interleave(per, dim=1)

    def sub(value: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
        s = torch.where(unit != 0, torch.round(value / torch.where(unit != 0, unit, 1.0)), 0.0)
        if not torch.equal(s * unit, value) or s.min().item() < 0 or s.max().item() > 255:
            raise ValueError("the K-quant scales are not f16 super-scales times byte sub-scales")
        return s

    sc, m = sub(scale, d), sub(-offset, dmin)
    if not torch.equal(super_scale.to(torch.float16).to(torch.float32), super_scale):
        raise ValueError("the K-quant super-scales are not halves")
    np_ = -(-n // group) * group
    groups = np_ // group

    def grouped(t: torch.Tensor) -> torch.Tensor:
        t = torch.nn.functional.pad(t, (0, 0, 0, np_ - n))
        return t.view(groups, group, nb).transpose(1, 2).to(torch.uint8).contiguous()

    sup = torch.nn.functional.pad(super_scale, (0, 0, 0, 0, 0, np_ - n)).view(groups, group, -1, 2)
    return grouped(sc), grouped(m), sup.permute(0, 2, 3, 1).to(torch.float16).contiguous()
