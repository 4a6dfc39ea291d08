"""A float32 step over a bfloat16 KV cache (``--kv-cache-dtype bfloat16``) in the native attention kernels, at every
instruction-set level this CPU can run:

- the write: every new token's K and V rows are the float32 rows (k as the kernel rotated it) rounded to bfloat16
  as torch rounds them (to nearest even), bit for bit, and no other slot moves;
- the read: decodes, prompt tiles, a sliding window and the key mass of KV eviction see exactly the bfloat16 cache
  widened to float32, the arithmetic float32 throughout (the output equals float32 SDPA over that cache);
- the refusals: a cache of any other 16-bit type under a float32 step.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.cpu_ops import KernelError
from tests.kernels.test_attention_eviction import SCORED, expected_mass
from tests.kernels.test_cpu_kernels import MIXES, TOL, head_major, make_step, split_heads
from tests.kernels.test_kv_int8 import attention_over as int8_reference
from tests.kernels.test_kv_int8 import key_mass_buffer, new_slots
from tests.kernels.test_kv_int8 import run_int8 as run_step

# block size, heads, kv heads, head size: SmolLM2's shape, a GQA group of 3 at the other compiled size (and a
# block of one token), the generic path with one head per kv head
SHAPES = [(16, 9, 3, 64), (1, 6, 2, 128), (32, 4, 4, 32)]


def bf16_step(reqs, heads, kv_heads, head_dim, block_size, seed=0):
    """make_step's float32 step with its cache in bfloat16 (token-major [blocks, bs, KVH, D])."""
    qkv, k_cache, v_cache, table, qsl, seq_lens = make_step(reqs, heads, kv_heads, head_dim, block_size,
                                                            torch.float32, seed)
    return qkv, k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16), table, qsl, seq_lens


def attention_over(q, k_rows, v_rows, table, qsl, seq_lens, heads, kv_heads, scale, window=0):
    """Float32 SDPA of each request's queries over the token-major bfloat16 cache widened to float32."""
    return int8_reference(q, k_rows, v_rows, table, qsl, seq_lens, heads, kv_heads, scale, window,
                          read=lambda rows: rows.float())


@pytest.mark.parametrize("block_size,head_dim", [(1, 64), (16, 128), (16, 48)])
@pytest.mark.parametrize("mix", ["mixed", "prefills"])
def test_the_kernel_writes_rows_rounded_to_bfloat16(kernels, block_size, head_dim, mix):
    if not kernels.supports(torch.float32, head_dim):
        pytest.skip(f"head_dim {head_dim} is not whole vectors at this level")
    heads, kv_heads = 6, 2
    step = bf16_step(MIXES[mix], heads, kv_heads, head_dim, block_size)
    qkv, kc0, vc0, table, qsl, seq_lens = step
    for rope in (False, True):
        _, _, k, v, kc, vc = run_step(kernels, *step, heads, kv_heads, head_dim, 0.125, rope)
        slots = new_slots(table, qsl, seq_lens, block_size)
        flat_k, flat_v = kc.view(-1, kv_heads, head_dim), vc.view(-1, kv_heads, head_dim)
        # k as the kernel rotated it (in place, float32), rounded by torch: the same bits
        assert torch.equal(flat_k[slots].view(torch.int16), k.to(torch.bfloat16).view(torch.int16))
        assert torch.equal(flat_v[slots].view(torch.int16), v.to(torch.bfloat16).view(torch.int16))
        untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(flat_k[untouched], kc0.view(-1, kv_heads, head_dim)[untouched])
        assert torch.equal(flat_v[untouched], vc0.view(-1, kv_heads, head_dim)[untouched])


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", SHAPES, ids=["smollm2", "g3-d128", "g1-d32"])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_float32_attention_over_the_bfloat16_cache(kernels, block_size, heads, kv_heads, head_dim, mix):
    if not kernels.supports(torch.float32, head_dim):
        pytest.skip(f"head_dim {head_dim} is not whole vectors at this level")
    step = bf16_step(MIXES[mix], heads, kv_heads, head_dim, block_size)
    _, _, table, qsl, seq_lens = step[1:]
    scale = head_dim ** -0.5
    out, q, _, _, kc, vc = run_step(kernels, *step, heads, kv_heads, head_dim, scale, rope=True)
    assert out.dtype == torch.float32
    want = attention_over(q, kc, vc, table, qsl, seq_lens, heads, kv_heads, scale)
    torch.testing.assert_close(out, want, **TOL[torch.float32])


@pytest.mark.parametrize("window", [5, 40])
@pytest.mark.parametrize("mix", ["decodes", "mixed"])
def test_bfloat16_cache_sliding_window(kernels, window, mix):
    heads, kv_heads, head_dim = 6, 2, 64
    step = bf16_step(MIXES[mix], heads, kv_heads, head_dim, 16)
    _, _, table, qsl, seq_lens = step[1:]
    out, q, _, _, kc, vc = run_step(kernels, *step, heads, kv_heads, head_dim, 0.125, rope=True, window=window)
    want = attention_over(q, kc, vc, table, qsl, seq_lens, heads, kv_heads, 0.125, window)
    torch.testing.assert_close(out, want, **TOL[torch.float32])


@pytest.mark.parametrize("mix", ["decodes", "mixed"])
def test_bfloat16_cache_key_mass(kernels, mix):
    """KV eviction by score reads the keys' attention mass: over the bfloat16 cache, the widened keys'."""
    heads, kv_heads, head_dim, bs = 6, 2, 64, 16
    step = bf16_step(MIXES[mix], heads, kv_heads, head_dim, bs)
    _, _, table, qsl, seq_lens = step[1:]
    scored = SCORED[mix]
    mass, stride = key_mass_buffer(scored, seq_lens, kv_heads, bs)
    _, q, _, _, kc, _ = run_step(kernels, *step, heads, kv_heads, head_dim, 0.125, rope=True, key_mass=mass)
    want = expected_mass(q, kc.float(), table, qsl, seq_lens, scored, heads, kv_heads, 0.125, stride)
    torch.testing.assert_close(mass.mass, want, atol=1e-5, rtol=1e-4)


def test_a_float16_cache_under_a_float32_step_is_refused(kernels):
    heads, kv_heads, head_dim = 4, 4, 64
    qkv, kc, vc, table, qsl, seq_lens = bf16_step([(3, 2)], heads, kv_heads, head_dim, 16)
    q, k, v = split_heads(qkv, heads, kv_heads, head_dim)
    half = head_major(kc).to(torch.float16)
    with pytest.raises(KernelError, match="torch.float16 KV cache under a torch.float32 step"):
        kernels.attention(q, k, v, half, half, table, qsl, seq_lens, None, torch.empty(2, heads, head_dim), 0.1)
