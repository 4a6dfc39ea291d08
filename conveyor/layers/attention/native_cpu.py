"""The native CPU attention backend: one kernel call per layer for the whole step.

Decodes and prefill chunks (with or without cached context) alike: the kernel (conveyor/kernels) rotates q
and k (rope), stores the new K/V in the paged cache, then runs every request's causal attention reading K/V
straight from the cache through the block table, in float32 or bfloat16, at any head size the kernels serve
(``CpuKernels.supports``). No gathers, no per-request Python. Everything that does not depend on the layer is
built once per step here: the int64 metadata tensors and the kernel's work plan (``plan``), which every layer's
call, and the native layer stack, reads instead of planning again.
"""

from __future__ import annotations

import torch

from conveyor.layers.attention.metadata import AttentionMetadata


class NativeCpuAttention:
    """``forward(q, k, v, kv_cache, scale, rope=table)`` for every layer of one step (see module doc)."""

    name = "cpu-native"
    fuses_rope = True  # the model passes q, k unrotated plus the float32 rope table
    # The kernel reads only written slots: the cache is left unwritten, so start-up skips touching every page
    # and memory is committed only as blocks are first used.
    cache_needs_zeroing = False
    supports_layer_stack = True

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Head-major blocks, [2, num_blocks, num_kv_heads, block_size, head_dim]: one head's keys of a block are
        contiguous, the rows the kernel's dot products stream (see kernels.cpu_ops)."""
        return (2, num_blocks, num_kv_heads, block_size, head_dim)

    def __init__(self, meta: AttentionMetadata, kernels) -> None:
        self.meta, self.kernels = meta, kernels
        self.query_start = torch.tensor(meta.query_start_loc, dtype=torch.int64)
        self.seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int64)
        self.block_table = meta.block_table.contiguous()
        self._plan: tuple[tuple[int, int, int, int], torch.Tensor | None] | None = None

    def plan(self, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor | None:
        """The step's attention work plan for this head layout: built by the first layer's call, reused by the
        rest (the head layout is the model's, so in practice one plan per step)."""
        key = (num_heads, num_kv_heads, head_dim, torch.get_num_threads())
        if self._plan is None or self._plan[0] != key:
            self._plan = key, self.kernels.attention_plan(self.query_start, self.seq_lens, num_heads, num_kv_heads,
                                                          head_dim)
        return self._plan[1]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float,
                rope: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, d], k/v [T, KVH, d] (views into the fused qkv rows are fine; q and k are rotated in place
        when ``rope`` is given); writes the new K/V into ``kv_cache`` ([2, num_blocks, KVH, block_size, d]:
        head-major blocks) and returns [T, H, d]."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.meta.num_reqs:
            plan = self.plan(q.shape[1], k.shape[1], q.shape[2])
            self.kernels.attention(q, k, v, kv_cache[0], kv_cache[1], self.block_table, self.query_start,
                                   self.seq_lens, rope, out, scale, plan=plan)
        return out
