"""Bidirectional attention over a step's packed sequences: an encoder's self-attention, where each sequence's
queries see every key of their own sequence and nothing else (no causal mask, no KV cache, no padding).

The sequences lie back to back on one token axis (``PackedSequences``: flash-attention's varlen ``cu_seqlens``).
With the native CPU kernels (``conveyor.kernels``, csrc/encoder_attention.cpp) one call runs every sequence and
head of the step in one parallel region; without them, or for a layout they do not serve (float16, a head size
that is not a multiple of 16), one torch SDPA call per sequence. Per-sequence SDPA calls each end at their
threads' barrier, about 40 per layer in a full step, which on two loaded cores was most of attention's cost
(docs/embeddings.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PackedSequences:
    """A step's sequences on one token axis: sequence s owns rows [starts[s], starts[s + 1]); rows after
    starts[-1] (padding the caller added) belong to none. ``cu_seqlens`` is ``starts`` as the kernel reads it."""

    starts: list[int]
    cu_seqlens: torch.Tensor  # int64 [num_seqs + 1]

    @classmethod
    def of(cls, starts: list[int]) -> PackedSequences:
        starts = list(starts)
        return cls(starts, torch.tensor(starts, dtype=torch.int64))


def packed_attention(qkv: torch.Tensor, out: torch.Tensor, seqs: PackedSequences, kernels=None) -> None:
    """out[rows of s] = softmax(q k^T / sqrt(head_dim)) v within each sequence s, for every sequence of ``seqs``.

    qkv [rows, 3, H, D] (the fused projection's output: q, k and v are read as views of it), out [rows, H, D];
    rows after ``seqs.starts[-1]`` are left as they are. ``kernels``: a ``conveyor.kernels.CpuKernels`` (None: the
    torch path)."""
    heads, head_dim = qkv.shape[2], qkv.shape[3]
    if kernels is not None and qkv.device.type == "cpu" and kernels.encoder.supports(qkv.dtype, heads, heads,
                                                                                     head_dim):
        q, k, v = qkv.unbind(1)  # each [rows, H, D], a view with the rows' stride of qkv
        kernels.encoder.run(q, k, v, out, seqs.cu_seqlens, head_dim ** -0.5)
        return
    starts = seqs.starts
    for start, end in zip(starts[:-1], starts[1:]):
        q, k, v = qkv[start:end].permute(1, 2, 0, 3)[:, None].unbind(0)  # each [1, H, L, D], views of qkv
        # 4-D: torch's fused CPU kernel (flash) takes it; 3-D falls back to the math path, 5x the time
        out[start:end] = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1)
