"""A paged attention step built by hand for the attention backends' tests and checks: shuffled blocks, a cache
whose unowned slots are NaN (a read of one shows), optional holes in the tables. No Triton imports: the GPU check
(benchmarks/triton_attention_check.py) uses it with compiled kernels, the CPU tests with interpreted ones."""

from __future__ import annotations

import torch

from conveyor.layers.attention import AttentionMetadata


def make_step(reqs, block_size, heads, kv_heads, head_dim, dtype=torch.float32, seed=0, null_blocks=None,
              device="cpu"):
    """reqs: (num_computed, num_new) each, decodes first as the runner orders them. A random cache whose blocks
    are handed out shuffled; every slot no request owns is NaN, so a read of one shows. ``null_blocks``: request
    index -> how many leading table entries point at the null block (given back outside a sliding window; NaN
    here, zeroed in the engine), as core.sliding_window leaves a table. Built on the CPU, returned on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    null_blocks = null_blocks or {}
    num_blocks = sum(-(-(c + n) // block_size) for c, n in reqs) + 3
    null = num_blocks - 1
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    tables, slots, qsl = [], [], [0]
    for i, (computed, new) in enumerate(reqs):
        table = [order.pop() for _ in range(-(-(computed + new) // block_size))]
        for b in table:  # the request's computed slots hold K/V; the rest (written this step or never) stay NaN
            first = table.index(b) * block_size
            filled = max(0, min(block_size, computed - first))
            cache[:, b, :filled] = torch.randn(2, filled, kv_heads, head_dim, generator=gen).to(dtype)
        table[:null_blocks.get(i, 0)] = [null] * null_blocks.get(i, 0)
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(computed, computed + new)]
        qsl.append(qsl[-1] + new)
    width = max(len(t) for t in tables) + 1  # one more column of padding than any row needs: never read
    meta = AttentionMetadata(
        num_tokens=qsl[-1], block_size=block_size, slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=qsl, seq_lens=[c + n for c, n in reqs], num_computed=[c for c, _ in reqs],
        block_table=torch.tensor([t + [null] * (width - len(t)) for t in tables], dtype=torch.int64, device=device),
        num_decodes=sum(1 for _, n in reqs if n == 1))
    q = torch.randn(qsl[-1], heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(qsl[-1], kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(qsl[-1], kv_heads, head_dim, generator=gen).to(dtype)
    return meta, q.to(device), k.to(device), v.to(device), cache.to(device)
