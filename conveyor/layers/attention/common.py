"""What the attention backends share: the torch backends' base class, cache writes, context gathers, plain causal
attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from conveyor.layers.attention.base import AttentionBackend, reject_rope, window_allows
from conveyor.layers.attention.kv_layout import TOKEN_MAJOR
from conveyor.layers.attention.metadata import AttentionMetadata

# SDPA's kernels on a GPU, cuDNN's left out: it builds an execution graph per input shape, and the shapes of a
# continuous batch change every step (each request's chunk and context length), so on an H200 its CPU side cost
# ~300 us a call and left the GPU idle most of the step (docs/benchmarks.md, "The CUDA path").
_GPU_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; on a GPU without the cuDNN kernel (above)."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(_GPU_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store the K/V of all new tokens. Runs before any read, so a same-step prefix hit sees them."""
    if meta.num_tokens == 0:
        return
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    kv_cache[0].view(num_slots, *k.shape[1:]).index_copy_(0, meta.slot_mapping, k)
    kv_cache[1].view(num_slots, *v.shape[1:]).index_copy_(0, meta.slot_mapping, v)


def gather_context(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of positions 0 .. seq_len-1 of one request, each [seq_len, kv_heads, head_dim]."""
    nblk = -(-seq_len // kv_cache.shape[2])
    ids = block_ids[:nblk]
    k = kv_cache[0].index_select(0, ids).flatten(0, 1)[:seq_len]
    v = kv_cache[1].index_select(0, ids).flatten(0, 1)[:seq_len]
    return k, v


def causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          window: int = 0) -> torch.Tensor:
    """Plain causal attention of a sequence over its own fresh K/V (no cache): [n, H, d] -> [n, H, d]; with a
    sliding ``window``, each query sees its last ``window`` keys."""
    return attend_with_context(q, k, v, 0, scale, window)


def attend_with_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, computed: int, scale: float,
                        window: int = 0) -> torch.Tensor:
    """n queries at slots computed .. computed + n - 1 over keys 0 .. computed + n - 1 (bottom-right aligned
    causal, and the sliding ``window`` when given): [n, H, d] -> [n, H, d]."""
    n, seq_len = q.shape[0], k.shape[0]
    mask = {"is_causal": True} if computed == 0 and not window else {"attn_mask": window_allows(
        torch.arange(computed, computed + n, device=q.device), torch.arange(seq_len, device=q.device), window)}
    out = sdpa(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        scale=scale, enable_gqa=q.shape[1] != k.shape[1], **mask)
    return out.squeeze(0).transpose(0, 1)


class TorchAttention:
    """The torch backends' declarations and their ``forward``: refuse the RoPE table, write the new K/V, then
    ``attend`` (the subclass's). Token-major caches; no fusion, no layer stack, no in-kernel eviction."""

    name: str
    kv_layout = TOKEN_MAJOR
    kv_cache_dtypes = ("auto",)  # K/V in the model's dtype: the int8 cache is read by the native kernels only
    cache_needs_zeroing = False  # reads only the slots of each request's context (a subclass may say otherwise)
    fuses_rope = False
    supports_layer_stack = False
    evicts_in_kernel = False
    graph_capturable = False  # builds its step's tensors from host lists (a copy a graph cannot replay)

    def __init__(self, meta: AttentionMetadata, dtype: torch.dtype = torch.float32) -> None:
        self.meta = meta

    @classmethod
    def for_step(cls, meta: AttentionMetadata, dtype: torch.dtype,
                 scored: dict[int, int] | None = None) -> AttentionBackend:
        return cls(meta, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                scale: float, rope: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        """q [T, H, d], k/v [T, KVH, d] for the new tokens; returns [T, H, d] (``window``: base.AttentionBackend)."""
        reject_rope(self.name, rope)
        write_kv(kv_cache, k, v, self.meta)
        return self.attend(q, k, v, kv_cache, scale, window)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float,
               window: int) -> torch.Tensor:
        """The step's attention (a layer with sliding ``window``, 0: none), the new K/V already in ``kv_cache``."""
        raise NotImplementedError
