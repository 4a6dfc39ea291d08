"""Per-key attention mass for KV eviction by score (h2o, snapkv), beside a torch backend that runs the step.

``KeyMassAttention`` wraps the step's backend: every layer's ``forward`` runs the backend unchanged (its output is
the step's, bit for bit), then recomputes, in torch and in float32, the softmax of the scored query rows over
their keys and adds its mass per KV block, summed over heads, into a per-request accumulator that the runner reads
once after the forward pass (summed over layers too).

The native CPU backend does not come here: its kernels add the mass themselves (``NativeCpuAttention``,
csrc/attention_mass.h), at a few percent of a step, and keep the one-call layer stack. This side pass serves the
``reference``, ``cpu-torch`` and ``cuda`` backends and both KV layouts; it costs an extra QK product per scored
row per layer (docs/kv-eviction.md). Nothing here runs unless the scheduler asks for scores.
"""

from __future__ import annotations

import torch

from conveyor.layers.attention.base import AttentionBackend
from conveyor.layers.attention.kv_layout import KVLayout
from conveyor.layers.attention.metadata import AttentionMetadata


class KeyMassAttention:
    """``inner`` for the step, plus the attention mass per block of the requests in ``scored``.

    ``scored`` maps a request's index in the step (its ``AttentionMetadata`` row) to how many of its last query
    rows count. ``layout``: the backend's cache layout, through which the keys are read."""

    supports_layer_stack = False  # one native call for every layer leaves no place to read q between them

    def __init__(self, inner: AttentionBackend, meta: AttentionMetadata, scored: dict[int, int],
                 layout: KVLayout) -> None:
        self.inner, self.meta, self.layout = inner, meta, layout
        self.name = inner.name
        self.fuses_rope = inner.fuses_rope
        self.scored = scored
        bs = meta.block_size
        # decodes (one row each) share one batched pass; chunks go one at a time
        self.decodes = [i for i in sorted(scored) if i < meta.num_decodes]
        self.chunks = [i for i in sorted(scored) if i >= meta.num_decodes]
        self.mass: dict[int, torch.Tensor] = {}
        self._kbuf: torch.Tensor | None = None  # the decodes' gathered keys, reused by every layer
        if self.decodes:
            lens = torch.tensor([meta.seq_lens[i] for i in self.decodes], device=meta.block_table.device)
            nb = -(-int(lens.max()) // bs)
            self._dec_ids = meta.block_table[self.decodes, :nb]
            self._dec_valid = torch.arange(nb * bs, device=lens.device) < lens[:, None]  # [n, L]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float,
                rope: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        if window:  # the engine refuses KV eviction for a windowed model at start-up (engine.args)
            raise ValueError("attention scores for KV eviction are not computed for sliding-window layers")
        out = self.inner.forward(q, k, v, kv_cache, scale, rope=rope) if rope is not None else \
            self.inner.forward(q, k, v, kv_cache, scale)
        kv_heads = k.shape[1]
        if self.decodes:
            self._decode_mass(q, kv_cache, kv_heads, scale)
        for i in self.chunks:
            self._chunk_mass(i, q, kv_cache, kv_heads, scale)
        return out

    def _add(self, i: int, per_block: torch.Tensor) -> None:
        acc = self.mass.get(i)
        self.mass[i] = per_block if acc is None else acc + per_block

    def _decode_mass(self, q: torch.Tensor, kv_cache: torch.Tensor, kv_heads: int, scale: float) -> None:
        meta, bs = self.meta, self.meta.block_size
        rows = [meta.query_start_loc[i] for i in self.decodes]
        n, d = len(rows), q.shape[2]
        ids = self._dec_ids
        nb = ids.shape[1]
        # Gather whole blocks into one buffer that every layer reuses (a fresh 3 MB tensor per layer page-faults),
        # and keep the cache's block layout: the scores come out [n, blocks, KVH, G, slots] with no transposed
        # copy of the keys, and the softmax runs over (blocks, slots) by hand.
        if self._kbuf is None:
            self._kbuf = kv_cache.new_empty(ids.numel(), *kv_cache.shape[2:])
        torch.index_select(kv_cache[0], 0, ids.flatten(), out=self._kbuf)
        # [n, nb, KVH, bs, d] (token-major: a strided view, which matmul copies)
        keys = self.layout.heads_first(self._kbuf.view(n, nb, *kv_cache.shape[2:]))
        qd = q[rows].view(n, 1, kv_heads, -1, d).to(keys.dtype)  # [n, 1, KVH, G, d]
        s = torch.matmul(qd, keys.transpose(-1, -2)).float() * scale  # [n, nb, KVH, G, bs]
        s.masked_fill_(~self._dec_valid.view(n, nb, 1, 1, bs), float("-inf"))  # also hides unwritten slots
        peak = s.amax(dim=(1, 4), keepdim=True)
        p = (s - peak).exp_()
        p /= p.sum(dim=(1, 4), keepdim=True)
        per_block = p.sum(dim=(2, 3, 4))  # [n, nb]
        for j, i in enumerate(self.decodes):  # each its own table's blocks, not the batch's widest
            self._add(i, per_block[j, :-(-meta.seq_lens[i] // bs)])

    def _chunk_mass(self, i: int, q: torch.Tensor, kv_cache: torch.Tensor, kv_heads: int, scale: float) -> None:
        meta, bs = self.meta, self.meta.block_size
        end, seq_len, rows = meta.query_start_loc[i + 1], meta.seq_lens[i], self.scored[i]
        nb = -(-seq_len // bs)
        d = q.shape[2]
        # one batched GEMM per KV head over the rows x group, the scale folded into the (few) query rows
        qc = (q[end - rows:end].float() * scale).view(rows, kv_heads, -1, d).transpose(0, 1)  # [KVH, r, G, d]
        g = qc.shape[2]
        keys = self.layout.keys(kv_cache, meta.block_table[i, :nb]).float()  # [KVH, L, d]
        s = torch.bmm(qc.reshape(kv_heads, rows * g, d), keys.transpose(1, 2)).view(kv_heads, rows, g, nb * bs)
        # row j of the r sits at slot seq_len - rows + j and sees keys 0 .. that slot: every key before the rows
        # is seen by all of them, so only the columns from the first row's slot on need the causal mask
        first = seq_len - rows
        q_slot = torch.arange(first, seq_len, device=q.device)[:, None]
        allowed = torch.arange(first, nb * bs, device=q.device)[None, :] <= q_slot  # [r, L - first]
        s[..., first:].masked_fill_(~allowed[None, :, None, :], float("-inf"))
        s.sub_(s.amax(dim=-1, keepdim=True)).exp_()  # the softmax in place: s is this call's own
        s.div_(s.sum(dim=-1, keepdim=True))
        mass = s.sum(dim=(0, 1, 2))  # [L]
        self._add(i, mass.view(nb, bs).sum(dim=-1))

    def block_scores(self) -> dict[int, list[float]]:
        """Request index -> attention mass per block of its table, summed over the layers run so far."""
        return {i: m.tolist() for i, m in self.mass.items()}
