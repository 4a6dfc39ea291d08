"""A GGUF file (llama.cpp's format): its metadata, its tensor directory, and tensors dequantized into torch.

The format's constants (magic, value types, quantization types and block sizes) and the dequantization of every
type come from the ``gguf`` package, llama.cpp's own Python library. One part is done here, for load time: the
header. ``gguf.GGUFReader`` builds one numpy view per array element; on SmolLM2's 98,000 tokenizer strings that
took 5.4-5.8 s here (more than the whole load budget), where this parser, which follows the same layout with
``struct``, took 0.12-0.16 s in the same conditions. ``tests/models/test_gguf.py`` checks that both readers agree on every
field and tensor.

Tensors are dequantized by ``gguf.quants.dequantize`` (every type it implements: Q4_0, Q4_1, Q5_*, Q8_0, the
K-quants, IQ types, ...); a type it cannot dequantize is a ``GGUFError`` naming the type.

Layout (little-endian; llama.cpp's ``docs/gguf.md``)::

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: string, type: u32, value)                 string = u64 length + UTF-8 bytes
    n_tensors x (name: string, n_dims: u32, dims: u64 x n_dims, type: u32, offset: u64)
    padding to general.alignment (default 32) | tensor data (each at data start + offset)

``dims`` lists the fastest-varying dimension first, so a [rows, cols] matrix has ``dims == [cols, rows]``.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType


class GGUFError(ValueError):
    """A GGUF file that cannot be read: truncated, corrupt, or holding something conveyor does not support."""


_SCALARS = {  # value type -> struct format
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
          GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
          GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
          GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8"}
_SUPPORTED_VERSIONS = (2, 3)
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory. ``shape`` is numpy order (slowest dimension first)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int


class _Cursor:
    """Sequential little-endian reads over a buffer; running past its end is a GGUFError (a truncated file)."""

    def __init__(self, buf, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF file (header ends at byte {len(self.buf)})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def value(self, vtype: int):
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise GGUFError(f"{self.path}: corrupt GGUF file (unknown metadata value type {vtype})") from None
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        return self.unpack(_SCALARS[vtype])

    def array(self):
        item_type, n = self.unpack("<I"), self.unpack("<Q")
        if item_type in _NUMPY:  # numbers: one slice, no per-element work
            dtype = np.dtype(_NUMPY[GGUFValueType(item_type)])
            end = self.pos + n * dtype.itemsize
            if end > len(self.buf):
                raise GGUFError(f"{self.path}: truncated GGUF file (an array of {n} values runs past the end)")
            values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).tolist()
            self.pos = end
            return values
        if n > len(self.buf):  # every element takes at least one byte: a corrupt count, not a huge array
            raise GGUFError(f"{self.path}: corrupt GGUF file (an array claims {n} elements)")
        if item_type == GGUFValueType.STRING:
            return self.strings(n)
        return [self.value(item_type) for _ in range(n)]

    def strings(self, n: int) -> list[str]:
        """``n`` strings in a row (a vocabulary: 49,152 here), in one tight loop."""
        buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out = []
        for _ in range(n):
            if pos + 8 > end:
                break
            (k,) = length(buf, pos)
            pos += 8 + k
            if pos > end:
                break
            # surrogateescape: some vocabularies hold byte tokens that are not valid UTF-8 on their own
            out.append(buf[pos - k:pos].decode("utf-8", errors="surrogateescape"))
        if len(out) < n:
            raise GGUFError(f"{self.path}: truncated GGUF file (an array of {n} strings runs past the end)")
        self.pos = pos
        return out


class GGUFFile:
    """An open GGUF file: ``metadata`` (key -> value), ``tensors`` (name -> TensorInfo) and ``load(name)``.

    Opening reads the header only and checks that every tensor lies inside the file, so a truncated or corrupt
    file fails here, with a GGUFError, not in the middle of loading weights.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file {path!r} does not exist")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GGUFError(f"{path}: not a GGUF file (only {size} bytes)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write: writable views, no copies
        cur = _Cursor(self._map, path)
        if cur.unpack("<I") != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (bad magic bytes)")
        self.version = cur.unpack("<I")
        if self.version not in _SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if self.version & 0xFFFF == 0 else ""
            raise GGUFError(f"{path}: unsupported GGUF version {self.version}{hint}; supported: 2, 3")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        if n_tensors > size or n_kv > size:
            raise GGUFError(f"{path}: corrupt GGUF file ({n_tensors} tensors, {n_kv} metadata keys)")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("<I"))
        infos = [self._tensor_entry(cur) for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{path}: corrupt GGUF file (alignment {alignment} is not a power of two)")
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, rel_offset, nbytes in infos:
            info = TensorInfo(name, shape, qtype, data_start + rel_offset, nbytes)
            if info.offset + nbytes > size:
                raise GGUFError(f"{path}: truncated GGUF file: tensor {name!r} ends at byte "
                                f"{info.offset + nbytes}, the file has {size}")
            if name in self.tensors:
                raise GGUFError(f"{path}: corrupt GGUF file (tensor {name!r} appears twice)")
            self.tensors[name] = info

    def _tensor_entry(self, cur: _Cursor):
        name = cur.string()
        n_dims = cur.unpack("<I")
        if n_dims > 8:
            raise GGUFError(f"{self.path}: corrupt GGUF file (tensor {name!r} has {n_dims} dimensions)")
        dims = [cur.unpack("<Q") for _ in range(n_dims)]
        raw_type, offset = cur.unpack("<I"), cur.unpack("<Q")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{self.path}: tensor {name!r} has quantization type {raw_type}, which the gguf "
                            "package does not know (a newer llama.cpp format?)") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(dims)) if dims else 1
        if dims and dims[0] % block:
            raise GGUFError(f"{self.path}: tensor {name!r}: row of {dims[0]} values is not a whole number of "
                            f"{qtype.name} blocks ({block})")
        return name, tuple(reversed(dims)), qtype, offset, n // block * type_size

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor ``name`` (uint8, no copy: a view of the mapped file)."""
        info = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor ``name`` dequantized to ``dtype``, shaped ``TensorInfo.shape`` (a fresh, writable tensor)."""
        info = self.tensors[name]
        values = dequantize(self.raw(name), info.qtype, name)
        return values.reshape(info.shape).to(dtype)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a tensor view still points into the map: it closes when the last view goes
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, name: str = "tensor") -> torch.Tensor:
    """Stored bytes of one tensor -> a flat float tensor (float32; float16 / bfloat16 stay as stored).

    Quantized types go through the ``gguf`` package's class for the type (``gguf.quants.Q4_1`` ...), over the
    whole tensor at once: ``gguf.quants.dequantize`` would cut it into groups of 16 rows, which cost 40% more on
    the wheel's model here (2.3-2.6 s against 1.2-1.5 s, same results)."""
    q = GGMLQuantizationType
    plain = {q.F32: torch.float32, q.F16: torch.float16, q.BF16: torch.bfloat16}
    if qtype in plain:
        return torch.from_numpy(raw).view(plain[qtype]).clone()
    import gguf.quants

    quant = getattr(gguf.quants, qtype.name, None)
    if quant is None or not hasattr(quant, "dequantize_rows"):
        raise GGUFError(f"tensor {name!r} is quantized as {qtype.name}, which the gguf package cannot "
                        "dequantize; convert the model to another type (e.g. Q8_0, Q4_K_M or F16)")
    quant.init_grid()  # the lattice tables of the IQ types; a no-op for the others
    try:
        values = quant.dequantize_rows(raw)
    except NotImplementedError:
        raise GGUFError(f"tensor {name!r} is quantized as {qtype.name}, which the gguf package cannot "
                        "dequantize; convert the model to another type (e.g. Q8_0, Q4_K_M or F16)") from None
    return torch.from_numpy(values).reshape(-1)
