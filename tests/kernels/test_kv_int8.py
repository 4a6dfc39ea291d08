"""The int8 KV cache (``--kv-cache-dtype int8``) in the native attention kernels, at every instruction-set level this
CPU can run, against the torch reference of its rows (``layers.attention.kv_quant``):

- the write: every new token's K and V rows are the reference's quantization of what the kernel stored, byte for
  byte (the values and the float32 scale), and no other slot moves;
- the read: decodes, prompt tiles, sliding windows and the key mass of KV eviction see exactly the dequantized
  cache (the output equals SDPA over ``dequantize_rows`` of the cache the kernel left, q as the kernel rotated it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels.cpu_ops import KernelError, KeyMass
from conveyor.layers.attention.kv_quant import dequantize_rows, quantize_rows, rotate
from conveyor.layers.rotary import RotaryEmbedding
from tests.kernels.test_attention_eviction import SCORED, expected_mass
from tests.kernels.test_cpu_kernels import DTYPES, MIXES, TOL, head_major, make_step, one_thread, split_heads


# Decode scores over int8 keys are integer dot products with the query rounded to 16 bits (attention_int8.h): a
# relative error of up to 1.5e-5 of the row's largest value in each score, beside float32 rounding's 1e-7. An
# indexing or scale bug moves outputs by 1e-2 and more.
INT8_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: TOL[torch.bfloat16]}


def int8_step(reqs, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """make_step's step with its cache quantized: token-major int8 rows [blocks, bs, KVH, D + 4]."""
    qkv, k_cache, v_cache, table, qsl, seq_lens = make_step(reqs, heads, kv_heads, head_dim, block_size, dtype, seed)
    return qkv, quantize_rows(k_cache), quantize_rows(v_cache), table, qsl, seq_lens


def new_slots(table, qsl, seq_lens, block_size):
    """Flat slot of every new token, in token order."""
    slots = []
    for r in range(len(seq_lens)):
        n, length = int(qsl[r + 1] - qsl[r]), int(seq_lens[r])
        pos = torch.arange(length - n, length)
        slots.append(table[r, pos // block_size] * block_size + pos % block_size)
    return torch.cat(slots)


def attention_over(q, k_rows, v_rows, table, qsl, seq_lens, heads, kv_heads, scale, window=0, read=dequantize_rows):
    """SDPA of each request's queries (q [T, H, D] as the kernel left it) over the token-major cache as ``read``
    gives it in float32 (int8 rows dequantized; test_kv_bf16's bfloat16 rows widened)."""
    bs, d = k_rows.shape[1], q.shape[2]
    keys = read(k_rows).reshape(-1, kv_heads, d)
    values = read(v_rows).reshape(-1, kv_heads, d)
    out = torch.empty(q.shape[0], heads, d)
    with one_thread():
        for r in range(len(seq_lens)):
            s, e, length = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
            ctx = torch.arange(length)
            slots = table[r, ctx // bs] * bs + ctx % bs
            pos = torch.arange(length - (e - s), length)
            mask = ctx.unsqueeze(0) <= pos.unsqueeze(1)
            if window:
                mask &= ctx.unsqueeze(0) > pos.unsqueeze(1) - window
            o = F.scaled_dot_product_attention(q[s:e].float().transpose(0, 1), keys[slots].transpose(0, 1),
                                               values[slots].transpose(0, 1), attn_mask=mask, scale=scale,
                                               enable_gqa=True)
            out[s:e] = o.transpose(0, 1)
    return out


def run_int8(kernels, qkv, kc_rows, vc_rows, table, qsl, seq_lens, heads, kv_heads, head_dim, scale, rope, **kw):
    """One kernel call on copies of a step and its token-major cache (int8 rows here, bfloat16 in test_kv_bf16);
    returns (out, q, k, v as the kernel rotated them, k cache, v cache: token-major as given)."""
    x = qkv.clone()
    q, k, v = split_heads(x, heads, kv_heads, head_dim)
    kc, vc = head_major(kc_rows), head_major(vc_rows)
    out = torch.full((x.shape[0], heads, head_dim), float("nan"), dtype=qkv.dtype)
    cos_sin = RotaryEmbedding(head_dim, 512, 10000.0).cos_sin.flatten(1).contiguous() if rope else None
    kernels.attention(q, k, v, kc, vc, table, qsl, seq_lens, cos_sin, out, scale, **kw)
    return out, q, k, v, head_major(kc), head_major(vc)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size,head_dim", [(1, 64), (16, 128), (16, 48)])
@pytest.mark.parametrize("mix", ["mixed", "prefills"])
def test_the_kernel_writes_the_reference_rows(kernels, dtype, block_size, head_dim, mix):
    if not kernels.supports(dtype, head_dim):
        pytest.skip(f"head_dim {head_dim} is not whole vectors at this level")
    heads, kv_heads = 6, 2
    step = int8_step(MIXES[mix], heads, kv_heads, head_dim, block_size, dtype)
    qkv, kc0, vc0, table, qsl, seq_lens = step
    for rope in (False, True):
        _, _, k, v, kc, vc = run_int8(kernels, *step, heads, kv_heads, head_dim, 0.125, rope)
        slots = new_slots(table, qsl, seq_lens, block_size)
        flat_k, flat_v = kc.view(-1, kv_heads, head_dim + 4), vc.view(-1, kv_heads, head_dim + 4)
        # k as the kernel rotated it (in place, in the model's dtype), quantized by the reference: the same bytes
        assert torch.equal(flat_k[slots], quantize_rows(k))
        assert torch.equal(flat_v[slots], quantize_rows(v))
        untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(flat_k[untouched], kc0.view(-1, kv_heads, head_dim + 4)[untouched])
        assert torch.equal(flat_v[untouched], vc0.view(-1, kv_heads, head_dim + 4)[untouched])


# block size, heads, kv heads, head size: SmolLM2's shape, a GQA group of 3 at the other compiled size (and a
# block of one token), the generic path with one head per kv head
SHAPES = [(16, 9, 3, 64), (1, 6, 2, 128), (32, 4, 4, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", SHAPES, ids=["smollm2", "g3-d128", "g1-d32"])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_int8_attention_reads_the_dequantized_cache(kernels, dtype, block_size, heads, kv_heads, head_dim, mix):
    if not kernels.supports(dtype, head_dim):
        pytest.skip(f"head_dim {head_dim} is not whole vectors at this level")
    step = int8_step(MIXES[mix], heads, kv_heads, head_dim, block_size, dtype)
    _, _, table, qsl, seq_lens = step[1:]
    scale = head_dim ** -0.5
    out, q, _, _, kc, vc = run_int8(kernels, *step, heads, kv_heads, head_dim, scale, rope=True)
    want = attention_over(q, kc, vc, table, qsl, seq_lens, heads, kv_heads, scale)
    torch.testing.assert_close(out.float(), want, **INT8_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [5, 40])
@pytest.mark.parametrize("mix", ["decodes", "mixed"])
def test_int8_sliding_window(kernels, dtype, window, mix):
    heads, kv_heads, head_dim = 6, 2, 64
    step = int8_step(MIXES[mix], heads, kv_heads, head_dim, 16, dtype)
    _, _, table, qsl, seq_lens = step[1:]
    out, q, _, _, kc, vc = run_int8(kernels, *step, heads, kv_heads, head_dim, 0.125, rope=True, window=window)
    want = attention_over(q, kc, vc, table, qsl, seq_lens, heads, kv_heads, 0.125, window)
    torch.testing.assert_close(out.float(), want, **INT8_TOL[dtype])


def key_mass_buffer(scored: dict[int, int], seq_lens, kv_heads: int, bs: int) -> tuple[KeyMass, int]:
    """The step's key-mass buffer for ``scored`` (request -> trailing rows), as the attention backend builds it,
    and its stride: each request's keys padded to whole blocks and the kernel's 32-key chunks."""
    stride = -(-(-(-int(seq_lens.max()) // bs) * bs) // 32) * 32
    rows = torch.zeros(len(seq_lens), dtype=torch.int32)
    slot = torch.zeros(len(seq_lens), dtype=torch.int64)
    for n, (r, k) in enumerate(sorted(scored.items())):
        rows[r], slot[r] = k, n
    return KeyMass(torch.zeros(len(scored), kv_heads, stride), rows, slot), stride


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", ["decodes", "mixed"])
def test_int8_key_mass_is_the_softmax_over_dequantized_keys(kernels, dtype, mix):
    """KV eviction by score reads the keys' attention mass: over the int8 cache, the dequantized keys'."""
    heads, kv_heads, head_dim, bs = 6, 2, 64, 16
    step = int8_step(MIXES[mix], heads, kv_heads, head_dim, bs, dtype)
    _, _, table, qsl, seq_lens = step[1:]
    scored = SCORED[mix]
    mass, stride = key_mass_buffer(scored, seq_lens, kv_heads, bs)
    _, q, _, _, kc, _ = run_int8(kernels, *step, heads, kv_heads, head_dim, 0.125, rope=True, key_mass=mass)
    keys = dequantize_rows(kc)  # token-major [blocks, bs, KVH, D] float32
    want = expected_mass(q, keys, table, qsl, seq_lens, scored, heads, kv_heads, 0.125, stride)
    torch.testing.assert_close(mass.mass, want, atol=1e-4, rtol=1e-3)


def test_int8_rows_of_zeros_and_bad_widths(kernels):
    """A row of zeros stores scale 0 and reads back zeros; a cache whose rows are not head_dim + 4 is refused."""
    heads, kv_heads, head_dim = 4, 4, 64
    qkv, kc, vc, table, qsl, seq_lens = int8_step([(3, 2)], heads, kv_heads, head_dim, 16, torch.float32)
    qkv.zero_()
    _, _, _, _, kc2, _ = run_int8(kernels, qkv, kc, vc, table, qsl, seq_lens, heads, kv_heads, head_dim, 0.125,
                                  rope=False)
    written = kc2.view(-1, kv_heads, head_dim + 4)[new_slots(table, qsl, seq_lens, 16)]
    assert torch.equal(written, torch.zeros_like(written))
    q, k, v = split_heads(qkv, heads, kv_heads, head_dim)
    narrow = head_major(kc)[..., :head_dim].contiguous()
    with pytest.raises(KernelError, match="head_dim \\+ 4"):
        kernels.attention(q, k, v, narrow, narrow, table, qsl, seq_lens, None, torch.empty(2, heads, head_dim), 0.1)


def test_reference_quantization_bounds_the_error():
    """The reference itself: each rotated value within half a step of its row's scale, the row's largest exact,
    and the rotation orthogonal up to its block size (so the error of a row is the rotated row's error)."""
    for d in (64, 48):  # one block of 64; three blocks of 16
        x = torch.randn(50, 3, d) * torch.logspace(-3, 2, 50)[:, None, None]
        x[:, :, 5] *= 30  # an outlier channel, as keys have
        b = d & -d
        assert ((rotate(rotate(x)) - b * x).norm(dim=-1) <= 1e-5 * b * x.norm(dim=-1)).all()
        rows = quantize_rows(x)
        back = dequantize_rows(rows)
        y = rotate(x)
        scale = y.abs().amax(-1, keepdim=True) / 127
        assert ((rotate(back) - y).abs() <= scale / 2 + 1e-5 * y.abs().amax(-1, keepdim=True)).all()
        # the rotation's point: a row's error, relative to its norm, is about the same whatever its outliers
        err = (back - x).norm(dim=-1) / x.norm(dim=-1)
        assert err.max() < 0.02
        assert rows.dtype == torch.int8 and rows.shape == (50, 3, d + 4)


def test_rotation_is_the_walsh_hadamard_matrix():
    """rotate() is x times the Sylvester Hadamard matrix (block-diagonal for a head size that is not a power of 2)."""
    h = torch.ones(1, 1)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(7, 48)
    want = torch.cat([x[:, i:i + 16] @ h for i in (0, 16, 32)], dim=-1)
    torch.testing.assert_close(rotate(x), want, rtol=1e-5, atol=1e-5)
