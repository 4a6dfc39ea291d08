"""The native CPU attention backend: one kernel call per layer for the whole step.

Decodes and prefill chunks (with or without cached context) alike: the kernel (conveyor/kernels) rotates q
and k (rope), stores the new K/V in the paged cache, then runs every request's causal attention reading K/V
straight from the cache through the block table, in float32 or bfloat16, at any head size the kernels serve
(``CpuKernels.supports``). No gathers, no per-request Python. Everything that does not depend on the layer is
built once per step here: the int64 metadata tensors and the kernel's work plan (``plan``), which every layer's
call, and the native layer stack, reads instead of planning again.

KV eviction runs here too, in the same kernels: a step whose slots were shifted by eviction passes each request's
RoPE offset (position minus slot), and a step that scores (h2o, snapkv) has the kernels add each scored
request's attention mass per key into a buffer (``kernels.cpu_ops.KeyMass``) that ``block_scores`` sums per
block once the step is done. Either way the whole-model layer stack still runs the step.
"""

from __future__ import annotations

import torch

from conveyor.kernels.cpu_ops import KeyMass
from conveyor.layers.attention.kv_layout import HEAD_MAJOR
from conveyor.layers.attention.metadata import AttentionMetadata


class NativeCpuAttention:
    """``forward(q, k, v, kv_cache, scale, rope=table)`` for every layer of one step (see module doc)."""

    name = "cpu-native"
    fuses_rope = True  # the model passes q, k unrotated plus the float32 rope table
    # The kernel reads only written slots: the cache is left unwritten, so start-up skips touching every page
    # and memory is committed only as blocks are first used.
    cache_needs_zeroing = False
    supports_layer_stack = True
    evicts_in_kernel = True  # scores keys and rotates shifted slots itself (module doc)
    graph_capturable = False  # a CPU backend: no CUDA graphs
    # Head-major blocks, [2, num_blocks, num_kv_heads, block_size, head_dim]: one head's keys of a block are
    # contiguous, the rows the kernel's dot products stream.
    kv_layout = HEAD_MAJOR
    # int8: the kernels quantize each (token, head) row as they write it and dequantize as they read (kv_quant);
    # bfloat16 under a float32 model: rows rounded as written, widened as read, the arithmetic float32 throughout
    kv_cache_dtypes = ("auto", "bfloat16", "int8")

    @classmethod
    def for_step(cls, meta: AttentionMetadata, dtype: torch.dtype,
                 scored: dict[int, int] | None = None) -> NativeCpuAttention:
        from conveyor.kernels import load_cpu_kernels  # built or loaded at engine start (resolve_backend)

        return cls(meta, load_cpu_kernels(), scored)

    def __init__(self, meta: AttentionMetadata, kernels, scored: dict[int, int] | None = None) -> None:
        """``scored``: request index -> how many of its last query rows put their attention mass into
        ``block_scores`` (KV eviction by score); None or empty: nothing is scored."""
        self.meta, self.kernels = meta, kernels
        self.query_start = torch.tensor(meta.query_start_loc, dtype=torch.int64)
        self.seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int64)
        self.block_table = meta.block_table.contiguous()
        self.rope_offset = torch.tensor(meta.rope_offsets, dtype=torch.int64) if meta.slots_shifted else None
        self.scored = dict(sorted(scored.items())) if scored else {}
        self.key_mass: KeyMass | None = None  # allocated by the first layer's call, when it knows the kv heads
        self._plan: tuple[tuple[int, int, int, int], torch.Tensor | None] | None = None

    def mass_buffer(self, num_kv_heads: int) -> KeyMass | None:
        """The step's key-mass buffer for the scored requests (one per step, every layer adds into it)."""
        if not self.scored or self.key_mass is not None:
            return self.key_mass
        # keys padded to whole blocks, and to the kernel's 32-key chunks (cvk.h)
        bs = self.meta.block_size
        longest = -(-max(self.meta.seq_lens[i] for i in self.scored) // bs) * bs
        stride = -(-longest // 32) * 32
        rows = torch.zeros(self.meta.num_reqs, dtype=torch.int32)
        slot = torch.zeros(self.meta.num_reqs, dtype=torch.int64)
        for n, (i, r) in enumerate(self.scored.items()):
            rows[i], slot[i] = r, n
        self.key_mass = KeyMass(torch.zeros(len(self.scored), num_kv_heads, stride), rows, slot)
        return self.key_mass

    def block_scores(self) -> dict[int, list[float]]:
        """Request index -> attention mass per block of its table, summed over heads and the layers run."""
        if self.key_mass is None:
            return {}
        bs = self.meta.block_size
        per_key = self.key_mass.mass.sum(dim=1)  # [scored, stride]
        out = {}
        for n, i in enumerate(self.scored):
            nb = -(-self.meta.seq_lens[i] // bs)
            out[i] = per_key[n, :nb * bs].view(nb, bs).sum(dim=1).tolist()
        return out

    def plan(self, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor | None:
        """The step's attention work plan for this head layout: built by the first layer's call, reused by the
        rest (the head layout is the model's, so in practice one plan per step)."""
        key = (num_heads, num_kv_heads, head_dim, torch.get_num_threads())
        if self._plan is None or self._plan[0] != key:
            self._plan = key, self.kernels.attention_plan(self.query_start, self.seq_lens, num_heads, num_kv_heads,
                                                          head_dim)
        return self._plan[1]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float,
                rope: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        """q [T, H, d], k/v [T, KVH, d] (views into the fused qkv rows are fine; q and k are rotated in place
        when ``rope`` is given; ``window``: the layer's sliding window, 0 for none); writes the new K/V into
        ``kv_cache`` ([2, num_blocks, KVH, block_size, d]: head-major blocks; an int8 cache's rows are d + 4
        bytes, ``kv_quant``) and returns [T, H, d]."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.meta.num_reqs:
            plan = self.plan(q.shape[1], k.shape[1], q.shape[2])
            self.kernels.attention(q, k, v, kv_cache[0], kv_cache[1], self.block_table, self.query_start,
                                   self.seq_lens, rope, out, scale, plan=plan,
                                   key_mass=self.mass_buffer(k.shape[1]),
                                   rope_offset=self.rope_offset if rope is not None else None, window=window)
        return out
