"""The "triton" attention backend: the Triton paged attention kernel (``kernels.triton_attention``) for the whole
step, decodes and prompt chunks in one launch per layer, plus the KV write in one more.

What ``auto`` runs on a GPU without flash-attn. Its cache is the torch backends' token-major layout, so the
hand-over copies, KV eviction's key-mass pass and the padded baselines work on it unchanged. Everything a step's
layers share (the int32 query starts and sequence lengths, the launch shape) is built once, in ``for_step``.
On a CPU it runs only under Triton's interpreter (``TRITON_INTERPRET=1``): how the tests check it against the
reference backend, far too slow to serve with.
"""

from __future__ import annotations

import os

import torch

from conveyor.layers.attention.base import reject_rope
from conveyor.layers.attention.common import TorchAttention
from conveyor.layers.attention.metadata import AttentionMetadata

# Head sizes the kernel takes: any up to this (padded to a power of two inside the kernel, masked)
MAX_HEAD_DIM = 256
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_importable() -> bool:
    """Whether Triton imports here (its kernels then compile for a GPU, or run interpreted on a CPU)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_serves(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the "triton" backend can run a model of this dtype and head size on ``device``: Triton installed,
    and a GPU, or a CPU under the interpreter."""
    on_gpu = torch.device(device).type == "cuda"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return (on_gpu or interpreted) and dtype in _DTYPES and head_dim <= MAX_HEAD_DIM and triton_importable()


class TritonAttention(TorchAttention):
    """``forward``: the Triton KV write, then one Triton launch for every query row of the step."""

    name = "triton"
    graph_capturable = True  # with AttentionMetadata.device_lens, nothing of a call depends on host data

    def __init__(self, meta: AttentionMetadata, dtype: torch.dtype = torch.float32) -> None:
        from conveyor.kernels import triton_attention  # imports Triton: only where this backend was chosen

        super().__init__(meta, dtype)
        self.kernels = triton_attention
        device = meta.slot_mapping.device
        if meta.device_lens is not None:  # a captured decode graph's buffers
            self.query_start, self.seq_lens = meta.device_lens
        else:
            self.query_start = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device)
            self.seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32, device=device)
        self.block_table = meta.block_table.contiguous()  # the kernels index rows and slots with unit inner strides
        self.slot_mapping = meta.slot_mapping.contiguous()
        self.decode_only = meta.num_decodes == meta.num_reqs

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                scale: float, rope: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        """q [T, H, d], k/v [T, KVH, d] for the new tokens; returns [T, H, d] (``window``: base.AttentionBackend)."""
        reject_rope(self.name, rope)
        self.kernels.write_kv(kv_cache, k, v, self.slot_mapping)
        shape = self.kernels.LaunchShape(q.shape[1] // k.shape[1], self.decode_only)
        return self.kernels.paged_attention(q, kv_cache, self.block_table, self.query_start, self.seq_lens, scale,
                                            window, shape)
