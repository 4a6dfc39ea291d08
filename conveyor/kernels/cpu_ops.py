"""The native CPU kernels (csrc/: api.cpp is the C ABI) behind typed Python calls on torch tensors.

``load_cpu_kernels()`` builds the library for this CPU's instruction-set level (cached: seconds the first time
on a machine, milliseconds after) and returns a ``CpuKernels``, or None when they cannot run here: no x86
AVX2, no C++ compiler, a failed build (a warning then carries the compiler's message), or
``CONVEYOR_CPU_ISA=none``. Callers keep a torch path for None. The engine loads them while it starts, so the
first request never pays the build.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from conveyor.kernels.build import BuildError, build_library
from conveyor.kernels.cpu_features import LEVEL_FLAGS, cpu_features, kernel_level
from conveyor.kernels.encoder_ops import EncoderAttentionKernels, EncoderAttnArgs
from conveyor.kernels.lora_ops import LoraArgs, LoraKernels
from conveyor.kernels.w8a8_ops import W8A8Kernels
from conveyor.kernels.moe_ops import MoeArgs, MoeKernels

SOURCE_DIR = os.path.join(os.path.dirname(__file__), "csrc")
ABI_VERSION = 19  # csrc/cvk.h's CVK_ABI_VERSION
STOPPED = 1  # cvk.h's CVK_STOPPED: cvk_llama_layers stopped between layers at the caller's flag
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
KV_BF16 = 1  # csrc/cvk.h's CVK_KV_BF16: a float32 step's cache of bfloat16 values
KV_INT8 = 2  # csrc/cvk.h's CVK_KV_INT8: a cache of int8 rows, D values then a float32 scale (layers/attention/kv_quant)


class KernelError(RuntimeError):
    pass


_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class AttnArgs(ctypes.Structure):
    """csrc/cvk.h's CvkAttnArgs (what each field holds is written there); checked against the library on load."""

    _fields_ = [("q", _P), ("k", _P), ("v", _P), ("k_cache", _P), ("v_cache", _P), ("block_table", _P),
                ("query_start", _P), ("seq_lens", _P), ("cos_sin", _P), ("out", _P), ("plan", _P),
                ("key_mass", _P), ("score_rows", _P), ("mass_offset", _P), ("rope_offset", _P),
                ("q_stride", _I64), ("k_stride", _I64), ("v_stride", _I64), ("bt_stride", _I64), ("out_stride", _I64),
                ("mass_stride", _I64), ("window", _I64), ("dtype", _I32), ("num_reqs", _I32), ("H", _I32), ("KVH", _I32), ("D", _I32), ("bs", _I32),
                ("num_threads", _I32), ("scale", _F32), ("kv_dtype", _I32)]


class LayerStackArgs(ctypes.Structure):
    """csrc/cvk.h's CvkLayerStackArgs (``step``: the attention arguments every layer shares); checked on load."""

    _fields_ = [("step", AttnArgs), ("fields", _P), ("x", _P), ("residual", _P), ("h", _P), ("qkv", _P), ("attn", _P),
                ("gu", _P), ("act", _P), ("quant_scratch", _P), ("T", _I64), ("hidden", _I64), ("inter", _I64),
                ("use_amx", _I32), ("L", _I32), ("eps", _F32), ("quantized", _I32), ("moe_scratch", _P),
                ("moe_scratch_bytes", _I64), ("moe_inter", _I64), ("E", _I32), ("top_k", _I32),
                ("norm_topk_prob", _I32), ("qk_norm_across_heads", _I32), ("lora", _P), ("lora_linears", _P),
                ("stop", _P), ("stop_layers", _I64)]


class QuantWeight(ctypes.Structure):
    """csrc/cvk.h's CvkQuantWeight (the layout of a quantized weight); checked against the library on load."""

    _fields_ = [("qs", _P), ("scale", _P), ("offset", _P), ("super_scale", _P), ("next", _P), ("N", _I64),
                ("K", _I64), ("KP", _I64), ("kind", _I32), ("scale_format", _I32)]


class QuantGemmArgs(ctypes.Structure):
    """csrc/cvk.h's CvkQuantGemmArgs; checked against the library on load."""

    _fields_ = [("w", _P), ("x", _P), ("bias", _P), ("y", _P), ("scratch", _P), ("M", _I64), ("x_stride", _I64),
                ("y_stride", _I64), ("scratch_bytes", _I64), ("dtype", _I32), ("num_threads", _I32)]


_STRUCTS = {0: AttnArgs, 1: LayerStackArgs, 2: QuantWeight, 3: QuantGemmArgs, 4: MoeArgs,
            5: LoraArgs, 6: EncoderAttnArgs}  # cvk.h's CVK_STRUCT_*
_ERRORS = {-1: "out of memory", -2: "unsupported by this build (head size, group size or dtype)",
           -3: "bad argument (dtype, shape, or a plan built for other arguments)"}


def check_abi(lib: ctypes.CDLL, path: str) -> None:
    """The library's ABI version and every struct's layout (field names, offsets, sizes) must be the mirrors'."""
    if lib.cvk_abi_version() != ABI_VERSION:
        raise BuildError(f"{path}: ABI version {lib.cvk_abi_version()}, expected {ABI_VERSION}")
    lib.cvk_struct_layout.restype = ctypes.c_char_p
    lib.cvk_struct_layout.argtypes = [ctypes.c_int]
    for which, mirror in _STRUCTS.items():
        want = ";".join(f"{name}:{getattr(mirror, name).offset}:{getattr(mirror, name).size}"
                        for name, _ in mirror._fields_) + f";sizeof:{ctypes.sizeof(mirror)}"
        got = (lib.cvk_struct_layout(which) or b"").decode()
        if got != want:
            raise BuildError(f"{path}: {mirror.__name__} layout differs from the C struct:\n C:      {got}\n Python: {want}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass
class KeyMass:
    """Where the attention kernels add up attention mass per key for KV eviction by score (cvk.h, key_mass):
    ``mass`` float32 [slots, KVH, stride], zeroed by the caller and accumulated over calls; request r of the step
    is scored over its last ``score_rows[r]`` query rows (int32 [R], 0: not scored) into slot ``slot[r]``."""

    mass: torch.Tensor
    score_rows: torch.Tensor
    slot: torch.Tensor  # int64 [R]: request r's slot in ``mass`` (any value where score_rows[r] is 0)

    def fields(self) -> dict[str, int]:
        """The CvkAttnArgs / CvkLayerStackArgs fields that carry it."""
        stride = self.mass.shape[2]
        self._offsets = self.slot * (self.mass.shape[1] * stride)  # element offsets, kept alive with the call
        return dict(key_mass=self.mass.data_ptr(), score_rows=self.score_rows.data_ptr(),
                    mass_offset=self._offsets.data_ptr(), mass_stride=stride)


def _step_args(block_table: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
               cos_sin: torch.Tensor | None, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, scale: float, plan: torch.Tensor | None, key_mass: KeyMass | None,
               rope_offset: torch.Tensor | None) -> AttnArgs:
    """The step's part of an attention call (the same for every layer): ``cvk_attention`` adds a layer's q, k, v,
    out and caches, ``cvk_llama_layers`` takes it as its ``step``."""
    return AttnArgs(block_table=block_table.data_ptr(), query_start=query_start.data_ptr(),
                    seq_lens=seq_lens.data_ptr(), cos_sin=_ptr(cos_sin), plan=_ptr(plan),
                    rope_offset=_ptr(rope_offset), bt_stride=block_table.stride(0), dtype=_DTYPE_CODES[dtype],
                    num_reqs=seq_lens.shape[0], H=num_heads, KVH=num_kv_heads, D=head_dim, bs=block_size,
                    num_threads=torch.get_num_threads(), scale=scale, **(key_mass.fields() if key_mass else {}))


def kv_dtype_code(cache: torch.Tensor, head_dim: int, dtype: torch.dtype) -> int:
    """The kernels' kv_dtype for a cache tensor under a step of ``dtype``: the step's dtype (0), bfloat16 under a
    float32 step (KV_BF16), or int8 rows of head_dim + 4 (KV_INT8)."""
    if cache.dtype == dtype:
        return 0
    if cache.dtype == torch.bfloat16 and dtype == torch.float32:
        return KV_BF16
    if cache.dtype != torch.int8:
        raise KernelError(f"a {cache.dtype} KV cache under a {dtype} step: the kernels read the step's dtype, "
                          "bfloat16 under float32, or int8 rows")
    if cache.shape[-1] != head_dim + 4:
        raise KernelError(f"an int8 KV cache holds rows of head_dim + 4 = {head_dim + 4} bytes, got {cache.shape[-1]}")
    return KV_INT8


def _c_function(lib: ctypes.CDLL, name: str, restype, argtypes: list):
    """The library's C function ``name``, typed."""
    fn = lib[name]
    fn.restype, fn.argtypes = restype, argtypes
    return fn


class CpuKernels:
    """Loaded kernels of one instruction-set level. Every call checks shapes and dtypes it cannot handle."""

    def __init__(self, lib: ctypes.CDLL, level: str, path: str) -> None:
        self.level, self.path = level, path
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._attention = _c_function(lib, "cvk_attention", i32, [ctypes.POINTER(AttnArgs)])
        self._plan_bytes = _c_function(lib, "cvk_attention_plan_bytes", i64, [ctypes.POINTER(AttnArgs)])
        self._plan = _c_function(lib, "cvk_attention_plan", i32, [ctypes.POINTER(AttnArgs), p, i64])
        self._add_rmsnorm = _c_function(lib, "cvk_add_rmsnorm", i32, [i32, p, i64, p, p, p, i64, i64, f32, i32, i32])
        self._skinny = _c_function(lib, "cvk_skinny_gemm", i32, [i32, p, i64, i64, p, p, p, i64, i64, i64, i32])
        self._amx = _c_function(lib, "cvk_amx_gemm", i32, [p, i64, i64, p, p, p, i64, i64, i64, i32])
        # AMX tiles: only where the CPU has them and Linux grants the tile state to this process.
        self.amx = level == "avx512bf16" and cpu_features().has_amx and lib.cvk_amx_init() == 1
        # VDPBF16PS (AVX512_BF16): the bfloat16 skinny GEMM's dot products where AMX is not there (Zen 4/5, Cooper
        # Lake). Lower levels emulate bfloat16 in their skinny loop, which oneDNN outruns: they leave it to oneDNN.
        self.bf16_dot = level == "avx512bf16"
        self._set_amx_attention = _c_function(lib, "cvk_set_amx_attention", i32, [i32])
        self._set_amx_attention(int(self.amx))  # records what was granted; prefill QK^T on AMX where it was
        self._set_dot_attention = _c_function(lib, "cvk_set_dot_attention", i32, [i32])
        self._set_amx_qdot = _c_function(lib, "cvk_set_amx_qdot", i32, [i32])
        # The quantized GEMM's dot products on AMX-INT8 tiles (from csrc/kernels.h's AMX_QDOT_MIN_ROWS / _Q8 rows)
        # where the CPU has them: the same numbers as the VNNI loop, bit for bit, at a fraction of its cost.
        self.amx_int8 = self.amx and cpu_features().has_amx_int8 and self._set_amx_qdot(-1) > 0
        self._bind = _c_function(lib, "cvk_bind_threads", i32, [p, i32])
        self._silu_mul = _c_function(lib, "cvk_silu_mul", i32, [i32, p, p, i64, i64, i32])
        self._argmax_rows = _c_function(lib, "cvk_argmax_rows", i32, [i32, p, i64, i64, i64, p, i32])
        self._llama_layers = _c_function(lib, "cvk_llama_layers", i32, [ctypes.POINTER(LayerStackArgs)])
        self._quant_gemm = _c_function(lib, "cvk_quant_gemm", i32, [ctypes.POINTER(QuantGemmArgs)])
        self._quant_dequantize = _c_function(lib, "cvk_quant_dequantize", i32,
                                             [ctypes.POINTER(QuantWeight), p, i64, i32, p, i64, i32])
        self._quant_scratch = _c_function(lib, "cvk_quant_scratch_bytes", i64, [i64, i64])
        self.vnni = lib.cvk_quant_vnni() == 1  # the quantized GEMM's dot products on VPDPBUSD
        self.moe = MoeKernels(lib, self._check)  # a mixture's routed MLP (moe_ops)
        self.w8a8 = W8A8Kernels(lib, self._check)  # W8A8's activation quantization and epilogue (w8a8_ops)
        self.lora = LoraKernels(lib, self._check)  # many LoRA adapters' low-rank products in one step (lora_ops)
        self.encoder = EncoderAttentionKernels(lib, self._check)  # an encoder's packed sequences (encoder_ops)
        self.vector_width = lib.cvk_vector_width()
        self.max_head_dim = lib.cvk_max_head_dim()

    def supports(self, dtype: torch.dtype, head_dim: int | None = None) -> bool:
        """Whether the kernels serve ``dtype`` (float32, bfloat16) and, for attention, ``head_dim``: 64 and 128
        compiled in, any other multiple of the vector width (8 on AVX2, 16 on AVX-512) up to ``max_head_dim`` on
        the generic path."""
        return dtype in _DTYPE_CODES and (head_dim is None or (
            0 < head_dim <= self.max_head_dim and head_dim % self.vector_width == 0))

    def attention_plan(self, query_start: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, num_kv_heads: int,
                       head_dim: int) -> torch.Tensor | None:
        """The step's attention work plan (an opaque buffer) for ``attention(..., plan=)`` and ``llama_layers``:
        built once per step and read by every layer's call (it depends on the requests and heads, not the layer).
        query_start [R + 1] and seq_lens [R] int64 as ``attention`` takes them. None for a step without requests."""
        a = AttnArgs(query_start=query_start.data_ptr(), seq_lens=seq_lens.data_ptr(), num_reqs=seq_lens.shape[0],
                     H=num_heads, KVH=num_kv_heads, D=head_dim, num_threads=torch.get_num_threads())
        size = self._plan_bytes(ctypes.byref(a))
        if size <= 0:
            return None
        buf = torch.empty((size + 7) // 8, dtype=torch.int64)  # int64: 8-byte aligned
        self._check("cvk_attention_plan", self._plan(ctypes.byref(a), buf.data_ptr(), buf.numel() * 8))
        return buf

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, block_table: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                  cos_sin: torch.Tensor | None, out: torch.Tensor, scale: float,
                  plan: torch.Tensor | None = None, key_mass: KeyMass | None = None,
                  rope_offset: torch.Tensor | None = None, window: int = 0) -> None:
        """Rope (when ``cos_sin`` is given) + KV write + causal attention of every request of a step.

        q [T, H, D], k and v [T, KVH, D], each with unit strides inside a token's row (views of one fused qkv
        buffer are fine); q and k are rotated in place. k_cache and v_cache [num_blocks, KVH, block_size, D]
        contiguous (head-major blocks: one head's rows of a block contiguous, so a request's context streams in
        order; ``layers.attention.kv_layout.HEAD_MAJOR``), in q's dtype or int8 rows of D + 4 (``kv_quant``); block_table [R, max_blocks] int64 (row-major);
        query_start [R + 1] and seq_lens [R] int64 (request r's tokens sit at positions seq_lens[r] - n_r ...);
        cos_sin [positions, D] float32 (cos halves then sin halves); out [T, H, D], written (unit strides inside a
        row). ``plan``: the step's ``attention_plan`` (else the call plans for itself). ``key_mass``: add the scored
        requests' attention mass per key into it (``KeyMass``). ``rope_offset`` int64 [R]: request r's RoPE
        positions are its KV slots plus rope_offset[r] (KV eviction shifted them; None: the slots). ``window``: the
        layer's sliding window (0: none; not with ``rope_offset`` or ``key_mass``).
        """
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        for t in (q, k, v, out):
            if t.stride(2) != 1 or t.stride(1) != head_dim:
                raise KernelError(f"attention: rows must be dense [heads, head_dim], got strides {t.stride()}")
        a = _step_args(block_table, query_start, seq_lens, cos_sin, q.dtype, num_heads, num_kv_heads, head_dim,
                       k_cache.shape[2], scale, plan, key_mass, rope_offset)
        a.q, a.k, a.v, a.out = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        a.k_cache, a.v_cache, a.window = k_cache.data_ptr(), v_cache.data_ptr(), window
        a.kv_dtype = kv_dtype_code(k_cache, head_dim, q.dtype)
        a.q_stride, a.k_stride, a.v_stride, a.out_stride = q.stride(0), k.stride(0), v.stride(0), out.stride(0)
        self._check(f"cvk_attention (H={num_heads} KVH={num_kv_heads} D={head_dim})",
                    self._attention(ctypes.byref(a)))

    @staticmethod
    def _check(what: str, rc: int) -> None:
        if rc != 0:
            raise KernelError(f"{what} failed ({rc}: {_ERRORS.get(rc, 'unknown error')})")

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    out: torch.Tensor) -> None:
        """``residual += x; out = rmsnorm(residual) * weight`` (without residual: ``out = rmsnorm(x) * weight``)."""
        rows, n = out.shape
        rc = self._add_rmsnorm(_DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0),
                               None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                               rows, n, eps, residual is not None, torch.get_num_threads())
        if rc != 0:
            raise KernelError(f"cvk_add_rmsnorm failed ({rc})")

    @staticmethod
    def pack_skinny_weight(weight: torch.Tensor) -> torch.Tensor:
        """W [N, K] -> the skinny GEMM's layout: 16-column blocks, k-major inside (float32 [N/16, K, 16],
        bfloat16 [N/16, K/2, 16, 2]), N padded with zero columns to a multiple of 16."""
        n, k = weight.shape
        # (pad copies the whole weight: only when it must; the permuted copy below is the layout's one copy)
        w = torch.nn.functional.pad(weight, (0, 0, 0, (-n) % 16)) if n % 16 else weight
        if weight.dtype == torch.bfloat16:
            return w.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        return w.view(-1, 16, k).transpose(1, 2).contiguous()

    def skinny_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                      out: torch.Tensor) -> None:
        """out [M, N] = x [M, K] @ W.T + bias, W packed by ``pack_skinny_weight`` (rows of x unit-strided)."""
        rc = self._skinny(_DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(),
                          None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), out_features,
                          x.shape[1], torch.get_num_threads())
        if rc != 0:
            raise KernelError(f"cvk_skinny_gemm failed ({rc})")

    def amx_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                   out: torch.Tensor) -> None:
        """bfloat16 ``skinny_linear`` on AMX tiles (``self.amx`` must be True; in_features a multiple of 32)."""
        rc = self._amx(x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(),
                       None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), out_features,
                       x.shape[1], torch.get_num_threads())
        if rc != 0:
            raise KernelError(f"cvk_amx_gemm failed ({rc})")

    def llama_layers(self, fields: torch.Tensor, num_layers: int, hidden: int, inter: int, x: torch.Tensor,
                     residual: torch.Tensor, scratch: tuple[torch.Tensor, ...], block_table: torch.Tensor,
                     query_start: torch.Tensor, seq_lens: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                     num_kv_heads: int, head_dim: int, block_size: int, scale: float, eps: float,
                     plan: torch.Tensor | None = None, quant_scratch: torch.Tensor | None = None,
                     key_mass: KeyMass | None = None, rope_offset: torch.Tensor | None = None,
                     moe: dict | None = None, kv_dtype: int = 0,
                     lora: tuple[LoraArgs, torch.Tensor] | None = None,
                     stop: tuple[int, int] | None = None) -> bool:
        """A Llama-family decoder-layer stack in one call (cvk_llama_layers: layer_stack.cpp gives the layout of
        ``fields``, the per-layer pointers, and of the ``scratch`` buffers h, qkv, attn, gate_up, act). ``residual``
        holds the embeddings on entry; on return ``x`` holds the last layer's output, ``residual`` the stream.
        ``plan``: the step's ``attention_plan`` (else the call plans once for all its layers). ``quant_scratch``:
        given when the linear fields point at ``QuantWeight`` descriptors (``quant_scratch_bytes`` for x's rows and
        the largest in_features). ``key_mass``, ``rope_offset``: as ``attention`` takes them (the mass then sums
        every layer's). ``moe``: a mixture's LayerStackArgs fields (moe_scratch, moe_scratch_bytes, moe_inter, E,
        top_k, norm_topk_prob; ``models.native_stack``), and qk_norm_across_heads. ``kv_dtype``: the caches'
        ``kv_dtype_code``. ``lora``: the step's adapter segments (``lora.segments``) and the per-layer table
        of each linear's adapter weights (cvk.h's lora_linears; ``models.native_stack``). ``stop``: the address of
        an int32 flag word and the layer count before which it may stop the call (cvk.h's stop, stop_layers).
        Returns whether the call stopped there (the later layers not run)."""
        h, qkv, attn, gu, act = scratch
        step = _step_args(block_table, query_start, seq_lens, cos_sin, x.dtype, num_heads, num_kv_heads, head_dim,
                          block_size, scale, plan, key_mass, rope_offset)
        step.kv_dtype = kv_dtype
        s = LayerStackArgs(step=step, fields=fields.data_ptr(), x=x.data_ptr(), residual=residual.data_ptr(),
                           h=h.data_ptr(), qkv=qkv.data_ptr(), attn=attn.data_ptr(), gu=gu.data_ptr(),
                           act=act.data_ptr(), T=x.shape[0], hidden=hidden, inter=inter, use_amx=int(self.amx),
                           L=num_layers, eps=eps, quant_scratch=_ptr(quant_scratch),
                           quantized=int(quant_scratch is not None), **(moe or {}))
        if lora is not None:
            s.lora, s.lora_linears = ctypes.addressof(lora[0]), lora[1].data_ptr()
        if stop is not None:
            s.stop, s.stop_layers = stop
        rc = self._llama_layers(ctypes.byref(s))
        if rc == STOPPED:
            return True
        self._check("cvk_llama_layers", rc)
        return False

    def quant_scratch_bytes(self, rows: int, padded_in: int) -> int:
        """Scratch bytes ``quant_linear`` needs to quantize ``rows`` activation rows against a weight whose
        in_features are padded to ``padded_in`` (``QuantWeight.KP``), with the AMX-INT8 setting now in force (a
        step on the tiles also keeps its packed activations there: ``set_amx_qdot``)."""
        return self._quant_scratch(rows, padded_in)

    def quant_linear(self, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None, out: torch.Tensor,
                     scratch: torch.Tensor | None = None) -> None:
        """out [M, N] = x [M, K] @ W.T + bias for a quantized W (``weight``: its descriptor, whose tensors the
        caller keeps alive); x float32 or bfloat16 with unit-strided rows, out and bias of x's dtype."""
        m = x.shape[0]
        need = self.quant_scratch_bytes(m, weight.KP)
        if scratch is None or scratch.numel() < need:
            scratch = torch.empty(need, dtype=torch.uint8)
        a = QuantGemmArgs(w=ctypes.addressof(weight), x=x.data_ptr(), bias=_ptr(bias), y=out.data_ptr(),
                          scratch=scratch.data_ptr(), M=m, x_stride=x.stride(0), y_stride=out.stride(0),
                          scratch_bytes=scratch.numel(), dtype=_DTYPE_CODES[x.dtype],
                          num_threads=torch.get_num_threads())
        self._check(f"cvk_quant_gemm (N={weight.N} K={weight.K})", self._quant_gemm(ctypes.byref(a)))

    def quant_dequantize(self, weight: QuantWeight, rows: torch.Tensor | None, out: torch.Tensor) -> None:
        """out[i] = row ``rows[i]`` of W dequantized (rows None: every row in order); out [count, K] float32 or
        bfloat16 with unit-strided rows. A row index out of range is a KernelError."""
        count = out.shape[0]
        if rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous()):
            rows = rows.to(torch.int64).contiguous()
        self._check("cvk_quant_dequantize", self._quant_dequantize(
            ctypes.byref(weight), _ptr(rows), count, _DTYPE_CODES[out.dtype], out.data_ptr(), out.stride(0),
            torch.get_num_threads()))

    def set_amx_attention(self, on: bool) -> bool:
        """Run prefill attention's QK^T on AMX tiles (bfloat16; the default where AMX was granted) or on vector
        FMAs (for tests and benchmarks that compare the two). Returns whether AMX is now used."""
        return self._set_amx_attention(int(on)) == 1

    def set_dot_attention(self, on: bool) -> bool:
        """Run bfloat16 prefill attention's QK^T and PV on VDPBF16PS where AMX tiles do not (the default at the
        avx512bf16 level) or on float32 vector FMAs (for tests and benchmarks that compare the two). Returns
        whether VDPBF16PS is now used (never below the avx512bf16 level)."""
        return self._set_dot_attention(int(on)) == 1

    def set_amx_qdot(self, on: bool, min_rows: int | None = None) -> bool:
        """Run the quantized GEMM's integer dot products on AMX-INT8 tiles for steps of at least ``min_rows`` rows
        (None: the kernels' measured default; on by default where the CPU has AMX-INT8 and AMX was granted), or
        always on the VNNI loop (for tests and benchmarks that compare the two). Returns whether AMX is now used."""
        rows = (-1 if min_rows is None else max(1, min_rows)) if on and self.amx_int8 else 0
        return self._set_amx_qdot(rows) > 0

    def bind_threads(self, cpus: list[int]) -> int:
        """Pin torch's OpenMP threads, one per CPU of ``cpus`` (see cvk_bind_threads); returns how many."""
        arr = (ctypes.c_int * len(cpus))(*cpus)
        return self._bind(ctypes.cast(arr, ctypes.c_void_p), len(cpus))

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The index of each row's first maximum of x [rows, n] (unit stride inside a row), as int64 [rows];
        a NaN counts as the maximum (numpy's argmax). bfloat16 rows are read as they are: no float32 copy."""
        rows, n = x.shape
        if x.stride(1) != 1:
            raise KernelError(f"argmax_rows: rows must be dense, got strides {x.stride()}")
        out = torch.empty(rows, dtype=torch.int64)
        rc = self._argmax_rows(_DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), rows, n, out.data_ptr(),
                               torch.get_num_threads())
        if rc != 0:
            raise KernelError(f"cvk_argmax_rows failed ({rc})")
        return out

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """out [rows, n] = silu(gate_up[:, :n]) * gate_up[:, n:] (gate_up contiguous [rows, 2n])."""
        rows, n = out.shape
        rc = self._silu_mul(_DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), rows, n,
                            torch.get_num_threads())
        if rc != 0:
            raise KernelError(f"cvk_silu_mul failed ({rc})")


_lock = threading.Lock()
_loaded: dict[str, CpuKernels | None] = {}


def load_cpu_kernels(level: str | None = None) -> CpuKernels | None:
    """The kernels for ``level`` (default: this CPU's, see cpu_features.kernel_level), or None with a warning
    saying why and that the torch path runs instead. Thread-safe; built at most once per process and level."""
    level = level or kernel_level()
    with _lock:
        if level not in _loaded:
            _loaded[level] = build_and_load(level)
        return _loaded[level]


def build_and_load(level: str) -> CpuKernels | None:
    """Build (or take from the cache) and load the kernels of ``level``, uncached in this process."""
    if level == "none":
        return None
    try:
        path = build_library("cpu_kernels", SOURCE_DIR, level, LEVEL_FLAGS[level])
        lib = ctypes.CDLL(path)
        check_abi(lib, path)
        return CpuKernels(lib, level, path)
    except (BuildError, OSError) as e:
        warnings.warn(f"conveyor: native CPU kernels ({level}) unavailable, using the torch path instead: {e}",
                      RuntimeWarning, stacklevel=3)
        return None
