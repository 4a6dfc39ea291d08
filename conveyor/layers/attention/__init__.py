"""Attention backends behind one interface (``base.AttentionBackend``).

A backend class (``base.AttentionBackendType``) owns its KV cache layout (``kv_layout``, ``cache_needs_zeroing``:
``allocate_kv_caches``) and declares what it fuses (``fuses_rope``, ``supports_layer_stack``) and whether its
kernels take KV eviction's steps themselves (``evicts_in_kernel``). ``make_attention(backend, meta, dtype,
padding)`` turns the step's ``AttentionMetadata`` into an object with ``forward(q, k, v, kv_cache, scale)`` that
every layer calls, through the class's one constructor ``for_step``; all per-step preparation happens once, there.
``forward`` first writes the K/V of ALL new tokens into the paged cache, then reads.

Backends: "reference" (the oracle), "cpu-native" (one native kernel call per layer for the whole step, RoPE
fused; where conveyor/kernels built for this CPU and serve the dtype and head size), "cpu-torch" (batched torch
ops; runs on any device), "cuda" (flash-attn's varlen paged kernel), "triton" (a Triton paged attention kernel;
on a GPU, or on a CPU under Triton's interpreter). Choices that pick one: "cpu" (cpu-native where it serves, else
cpu-torch) and "auto" (cuda on a GPU, else cpu; "cuda" falls back to triton, then cpu-torch). A step with a baseline's pad rows gets
its backend wrapped in ``padded.PaddedAttention``; a step whose KV eviction policy asks for attention scores,
in ``key_mass.KeyMassAttention``, unless the backend's kernels score keys themselves (``evicts_in_kernel``).
"""

from __future__ import annotations

import torch

from conveyor.core.config import ATTENTION_BACKENDS
from conveyor.layers.attention.base import AttentionBackend, AttentionBackendType, LayerStackAttention
from conveyor.layers.attention.cpu import CpuAttention
from conveyor.layers.attention.cuda import FlashAttention, flash_attention_serves
from conveyor.layers.attention.key_mass import KeyMassAttention
from conveyor.layers.attention.kv_layout import KVLayout
from conveyor.layers.attention.kv_quant import cache_dtype, row_width
from conveyor.layers.attention.metadata import AttentionMetadata
from conveyor.layers.attention.native_cpu import NativeCpuAttention
from conveyor.layers.attention.padded import PaddedAttention, Padding
from conveyor.layers.attention.reference import ReferenceAttention
from conveyor.layers.attention.triton_paged import TritonAttention, triton_serves

_CLASSES: dict[str, AttentionBackendType] = {cls.name: cls for cls in (ReferenceAttention, NativeCpuAttention,
                                                                      CpuAttention, FlashAttention, TritonAttention)}


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype, head_dim: int,
                    block_size: int) -> str:
    """The backend a step runs, one of ``backend_class``'s names: "auto" -> "cuda" on a GPU, else "cpu"; "cpu" ->
    "cpu-native" when the native CPU kernels built here and serve ``dtype`` and ``head_dim``, else "cpu-torch";
    "cuda" -> without flash-attn (or with a block size it does not take) "triton" on a GPU where Triton imports,
    else "cpu-torch" (its batched torch ops run on the GPU). "triton" is refused where it cannot run."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    on_gpu = torch.device(device).type == "cuda"
    if name == "auto":
        name = "cuda" if on_gpu else "cpu"
    if name == "cuda":
        if flash_attention_serves(block_size):
            return "cuda"
        return "triton" if on_gpu and triton_serves(device, dtype, head_dim) else "cpu-torch"
    if name == "triton" and not triton_serves(device, dtype, head_dim):
        raise ValueError(f"attention backend 'triton' cannot serve {dtype} with head size {head_dim} on {device}: it "
                         "needs Triton installed and a CUDA device (or TRITON_INTERPRET=1 on a CPU, for tests)")
    if name == "cpu":
        return "cpu-native" if not on_gpu and _native_serves(dtype, head_dim) else "cpu-torch"
    if name == "cpu-native" and (on_gpu or not _native_serves(dtype, head_dim)):
        raise ValueError(f"attention backend 'cpu-native' cannot serve {dtype} with head size {head_dim} on "
                         f"{device} (see the kernel build warning); choose 'cpu' to fall back to torch")
    return name


def _native_serves(dtype: torch.dtype, head_dim: int) -> bool:
    from conveyor.kernels import load_cpu_kernels  # builds (or loads) the native kernels: at engine start

    kernels = load_cpu_kernels()
    return kernels is not None and kernels.supports(dtype, head_dim)


def backend_class(backend: str) -> AttentionBackendType:
    """The class of a resolved backend name, for its declarations (KV layout, fusion flags)."""
    if backend not in _CLASSES:
        raise ValueError(f"unknown attention backend {backend!r}; resolve {ATTENTION_BACKENDS} with resolve_backend")
    return _CLASSES[backend]


def allocate_kv_caches(backend: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: torch.device,
                       kv_cache_dtype: str = "auto") -> list[torch.Tensor]:
    """One cache tensor per layer in the resolved backend's layout, zeroed only where the backend needs it; with
    ``kv_cache_dtype`` "int8", int8 rows of head_dim + 4 (``kv_quant``), or "bfloat16" (a float32 model's K/V in
    16 bits), refused where the backend cannot read them."""
    cls = backend_class(backend)
    if kv_cache_dtype not in cls.kv_cache_dtypes:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is read only by the native CPU attention kernels "
                         f"(cpu-native); attention backend {backend!r} keeps K/V in the model's dtype. Use "
                         "--attention-backend cpu on a CPU where the native kernels load (AVX2 or better, not "
                         "CONVEYOR_CPU_ISA=none), or --kv-cache-dtype auto")
    if kv_cache_dtype == "bfloat16" and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"kv_cache_dtype 'bfloat16' holds the K/V of a float32 (or bfloat16) model, not {dtype}")
    shape = cls.kv_layout.shape(num_blocks, block_size, num_kv_heads, row_width(head_dim, kv_cache_dtype))
    alloc = torch.zeros if cls.cache_needs_zeroing else torch.empty
    return [alloc(*shape, dtype=cache_dtype(dtype, kv_cache_dtype), device=device) for _ in range(num_layers)]


def make_attention(backend: str, meta: AttentionMetadata, dtype: torch.dtype,
                   padding: Padding | None = None, scored: dict[int, int] | None = None) -> AttentionBackend:
    """The per-step attention object for a resolved backend name; with ``padding``, wrapped to run the pad rows;
    with ``scored`` (request index -> trailing query rows), wrapped to add up their attention mass per KV block
    (``KeyMassAttention.block_scores``)."""
    assert padding is None or not scored, "KV eviction does not run beside the padded baselines"
    # A backend whose kernels score keys and rotate shifted slots by their request's offset (native_cpu, the one
    # that fuses RoPE) takes eviction's steps itself; the others rotate in the model and get the torch side pass.
    cls = backend_class(backend)
    attention = cls.for_step(meta, dtype, scored if cls.evicts_in_kernel else None)
    assert cls.evicts_in_kernel or not attention.fuses_rope, \
        "a RoPE-fusing backend must rotate by positions under eviction"
    if scored and not cls.evicts_in_kernel:
        return KeyMassAttention(attention, meta, scored, cls.kv_layout)
    return attention if padding is None else PaddedAttention(attention, meta.num_tokens, padding)


__all__ = ["AttentionBackend", "AttentionBackendType", "AttentionMetadata", "KVLayout", "KeyMassAttention",
           "LayerStackAttention", "Padding", "allocate_kv_caches", "backend_class", "make_attention",
           "resolve_backend"]
