"""What KV eviction asks of the native attention kernel, at every instruction-set level this CPU can run: the
attention mass per key of the scored rows (cvk.h's key_mass), equal to a plain softmax, with the step's output
bit-identical to an unscored call; and RoPE by per-request offsets when eviction shifted the KV slots."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.cpu_ops import KernelError, KeyMass
from conveyor.layers.rotary import RotaryEmbedding, apply_rotary
from tests.kernels.test_cpu_kernels import DTYPES, MIXES, TOL, head_major, make_step, split_heads

# request index -> trailing rows scored, per mix (a request left out is not scored)
SCORED = {
    "decodes": {0: 1, 1: 1, 4: 1, 8: 1, 10: 1},
    "few_decodes": {0: 1, 1: 1},
    "chunks_with_context": {0: 16, 1: 3, 2: 2, 3: 45},
    "mixed": {0: 1, 2: 1, 3: 7, 5: 30},
}


def expected_mass(q, k_cache, table, qsl, seq_lens, scored, heads, kv_heads, scale, stride):
    """Softmax of each scored row over the keys it sees, in float32, summed over a kv head's query heads: [n, KVH,
    stride]. q [T, H, D] as the kernel left it (rotated), k_cache token-major [blocks, bs, KVH, D] after the call."""
    bs, group = k_cache.shape[1], heads // kv_heads
    out = torch.zeros(len(scored), kv_heads, stride)
    for n, (r, rows) in enumerate(sorted(scored.items())):
        e, length = int(qsl[r + 1]), int(seq_lens[r])
        ctx = torch.arange(length)
        keys = k_cache.view(-1, kv_heads, k_cache.shape[3])[table[r, ctx // bs] * bs + ctx % bs].float()
        for t in range(e - rows, e):
            seen = length - (e - t)  # the row's own slot: it sees keys 0 .. seen
            w = torch.einsum("hd,lhd->hl", q[t].float(), keys[:seen + 1].repeat_interleave(group, dim=1)) * scale
            out[n, :, :seen + 1] += w.softmax(-1).view(kv_heads, group, -1).sum(1)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)], ids=["g1", "g3"])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize("mix", sorted(SCORED))
def test_key_mass_is_the_softmax_and_leaves_the_output_alone(kernels, dtype, block_size, heads, kv_heads, head_dim,
                                                              mix):
    if not kernels.supports(dtype, head_dim):
        pytest.skip(f"head_dim {head_dim} is not whole vectors at this level")
    reqs, scored = MIXES[mix], SCORED[mix]
    qkv, k_cache, v_cache, table, qsl, seq_lens = make_step(reqs, heads, kv_heads, head_dim, block_size, dtype)
    cos_sin = RotaryEmbedding(head_dim, 512, 10000.0).cos_sin.flatten(1).contiguous()
    scale = head_dim ** -0.5

    def run(key_mass):
        x = qkv.clone()
        q, k, v = split_heads(x, heads, kv_heads, head_dim)
        kc, vc = head_major(k_cache), head_major(v_cache)
        out = torch.empty(x.shape[0], heads, head_dim, dtype=dtype)
        kernels.attention(q, k, v, kc, vc, table, qsl, seq_lens, cos_sin, out, scale, key_mass=key_mass)
        return out, q, kc

    plain, _, _ = run(None)
    stride = -(-int(seq_lens.max()) // 32) * 32
    rows = torch.zeros(len(reqs), dtype=torch.int32)
    slot = torch.zeros(len(reqs), dtype=torch.int64)
    for n, (r, count) in enumerate(sorted(scored.items())):
        rows[r], slot[r] = count, n
    km = KeyMass(torch.zeros(len(scored), kv_heads, stride), rows, slot)
    out, q, kc = run(km)
    assert torch.equal(out, plain)  # scoring reads the softmax, never changes it
    want = expected_mass(q, head_major(kc), table, qsl, seq_lens, scored, heads, kv_heads, scale, stride)
    torch.testing.assert_close(km.mass, want, rtol=1e-4, atol=1e-5)
    # every scored row spreads one unit per query head; nothing lands past a request's keys
    for n, (r, count) in enumerate(sorted(scored.items())):
        assert km.mass[n].sum().item() == pytest.approx(heads * count, rel=1e-4)
        assert not km.mass[n, :, int(seq_lens[r]):].any()
    # a second call (another layer) adds to the same buffer
    again = km.mass.clone()
    run(km)
    torch.testing.assert_close(km.mass, 2 * again, rtol=1e-5, atol=1e-6)


def test_key_mass_buffer_too_short_is_refused(kernels):
    qkv, k_cache, v_cache, table, qsl, seq_lens = make_step([(40, 1)], 4, 4, 64, 16, torch.float32)
    q, k, v = split_heads(qkv, 4, 4, 64)
    km = KeyMass(torch.zeros(1, 4, 32), torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(KernelError, match="bad argument"):  # 41 keys need a stride of 64
        kernels.attention(q, k, v, head_major(k_cache), head_major(v_cache), table, qsl, seq_lens, None,
                          torch.empty(1, 4, 64), 0.125, key_mass=km)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", ["mixed", "decodes"])
def test_rope_offset_rotates_by_position_not_slot(kernels, dtype, mix):
    """KV eviction left request r's slots rope_offset[r] below its positions: rotating in the kernel by the offset
    equals rotating q and k at the positions beforehand and calling the kernel without rope."""
    heads, kv_heads, head_dim = 6, 2, 64
    reqs = MIXES[mix]
    qkv, k_cache, v_cache, table, qsl, seq_lens = make_step(reqs, heads, kv_heads, head_dim, 16, dtype)
    rotary = RotaryEmbedding(head_dim, 1024, 10000.0)
    offsets = torch.tensor([37 * (i % 3) for i in range(len(reqs))], dtype=torch.int64)

    x = qkv.clone()
    q, k, v = split_heads(x, heads, kv_heads, head_dim)
    kc, vc = head_major(k_cache), head_major(v_cache)
    out = torch.empty(x.shape[0], heads, head_dim, dtype=dtype)
    kernels.attention(q, k, v, kc, vc, table, qsl, seq_lens, rotary.cos_sin.flatten(1).contiguous(), out,
                      head_dim ** -0.5, rope_offset=offsets)

    y = qkv.clone()
    q2, k2, v2 = split_heads(y, heads, kv_heads, head_dim)
    positions = torch.cat([torch.arange(int(seq_lens[r]) - n, int(seq_lens[r])) + offsets[r]
                           for r, (_, n) in enumerate(reqs)])
    rope = rotary.lookup(positions)
    q2.copy_(apply_rotary(q2.float(), rope.cos, rope.sin).to(dtype))
    k2.copy_(apply_rotary(k2.float(), rope.cos, rope.sin).to(dtype))
    kc2, vc2 = head_major(k_cache), head_major(v_cache)
    want = torch.empty_like(out)
    kernels.attention(q2, k2, v2, kc2, vc2, table, qsl, seq_lens, None, want, head_dim ** -0.5)
    torch.testing.assert_close(kc.float(), kc2.float(), **TOL[dtype])
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
