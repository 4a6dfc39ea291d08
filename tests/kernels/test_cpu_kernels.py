"""The native CPU kernels against plain torch, at every instruction-set level this CPU can run.

Each level's library is built (or taken from the cache) by the test itself; a level above this CPU's is
skipped, so an AVX2-only machine tests the AVX2 build and this Xeon tests all three. Where no kernel can be
built at all (no compiler), the torch paths these kernels replace are what the engine runs, and the engine
tests cover them.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
import torch.nn.functional as F

from conveyor.layers.rotary import RotaryEmbedding, apply_rotary

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_step(reqs, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """reqs: (num_computed, num_new) per request. Returns tensors as the runner builds them, with a cache
    whose computed slots hold random K/V and blocks scattered over the pool."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in reqs) + 4
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables, qsl = [], [0]
    for computed, new in reqs:
        tables.append([free.pop() for _ in range(-(-(computed + new) // block_size))])
        qsl.append(qsl[-1] + new)
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    qkv = torch.randn(qsl[-1], (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    return qkv, k_cache, v_cache, block_table, torch.tensor(qsl), torch.tensor([c + n for c, n in reqs])


@contextlib.contextmanager
def one_thread():
    """The reference's many small ops run on one thread: on a shared, oversubscribed machine each OpenMP
    barrier of a 2-thread op can wait a whole scheduler slice (measured: 1 s instead of 0.02 s per case)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def reference_attention(qkv, k_cache, v_cache, block_table, qsl, seq_lens, rotary, heads, kv_heads, head_dim, scale,
                        window=0):
    """Rope, cache write and causal attention in float32, one request at a time (a query sees its last ``window``
    keys only, when given). Returns (out, k, v caches)."""
    with one_thread():
        return _reference_attention(qkv, k_cache, v_cache, block_table, qsl, seq_lens, rotary, heads, kv_heads,
                                    head_dim, scale, window)


def _reference_attention(qkv, k_cache, v_cache, block_table, qsl, seq_lens, rotary, heads, kv_heads, head_dim, scale,
                         window=0):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    bs = k_cache.shape[1]
    x = qkv.float().view(qkv.shape[0], heads + 2 * kv_heads, head_dim)
    out = torch.empty(qkv.shape[0], heads * head_dim)
    for r in range(len(seq_lens)):
        s, e, L = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        pos = torch.arange(L - (e - s), L)
        q, k, v = x[s:e, :heads], x[s:e, heads:heads + kv_heads], x[s:e, heads + kv_heads:]
        if rotary is not None:
            rope = rotary.lookup(pos)
            cos, sin = rope.cos, rope.sin
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
        new_slots = block_table[r, pos // bs] * bs + pos % bs
        flat_k[new_slots], flat_v[new_slots] = k.to(k_cache.dtype), v.to(v_cache.dtype)
        ctx = torch.arange(L)
        slots = block_table[r, ctx // bs] * bs + ctx % bs
        ks, vs = flat_k[slots].float(), flat_v[slots].float()  # [L, KVH, D]
        qf = q.to(qkv.dtype).float()  # the kernel sees q rounded to the model dtype, as the torch path does
        mask = torch.arange(L).unsqueeze(0) <= pos.unsqueeze(1)
        if window:
            mask &= torch.arange(L).unsqueeze(0) > pos.unsqueeze(1) - window
        o = F.scaled_dot_product_attention(qf.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = o.transpose(0, 1).reshape(e - s, heads * head_dim)
    return out, k_cache, v_cache


def head_major(cache):
    """[num_blocks, bs, KVH, D] (the reference's layout) -> the kernel's [num_blocks, KVH, bs, D], and back."""
    return cache.transpose(1, 2).contiguous()


def split_heads(qkv, heads, kv_heads, head_dim):
    """q, k, v as [T, heads, head_dim] views into the fused rows, as the model hands them over."""
    q = qkv[:, :heads * head_dim].unflatten(1, (heads, head_dim))
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].unflatten(1, (kv_heads, head_dim))
    v = qkv[:, (heads + kv_heads) * head_dim:(heads + 2 * kv_heads) * head_dim].unflatten(1, (kv_heads, head_dim))
    return q, k, v


MIXES = {
    "decodes": [(c, 1) for c in (0, 1, 15, 16, 17, 31, 32, 33, 64, 100, 300)],
    "few_decodes": [(5, 1), (40, 1)],  # fewer decodes than threads want items: a request's kv heads split
    "prefills": [(0, 1), (0, 7), (0, 33), (0, 70)],
    "chunks_with_context": [(16, 16), (5, 9), (31, 2), (40, 45)],
    "mixed": [(40, 1), (3, 1), (100, 1), (0, 20), (17, 5), (64, 30)],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2)], ids=["g1", "g3", "g4"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_attention_matches_torch(kernels, dtype, block_size, heads, kv_heads, head_dim, mix):
    check_attention(kernels, dtype, block_size, heads, kv_heads, head_dim, mix)


# Head sizes the generic path serves (every multiple of the vector width up to 256 but 64 and 128, which are
# compiled in): 16 is the tests' tiny models', 80 and 96 Phi's, 256 Gemma's; 40 is a multiple of 8, not of 16.
GENERIC_HEAD_DIMS = [16, 32, 40, 48, 80, 96, 256]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)], ids=["g3", "g1"])
@pytest.mark.parametrize("head_dim", GENERIC_HEAD_DIMS)
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_attention_generic_head_size_matches_torch(kernels, dtype, block_size, heads, kv_heads, head_dim, mix):
    if not kernels.supports(dtype, head_dim):
        assert head_dim % kernels.vector_width != 0  # only a size that is not whole vectors here is refused
        pytest.skip(f"head_dim {head_dim} is not a multiple of this level's vector width: the torch path")
    check_attention(kernels, dtype, block_size, heads, kv_heads, head_dim, mix)


def check_attention(kernels, dtype, block_size, heads, kv_heads, head_dim, mix, window=0):
    qkv, k_cache, v_cache, table, qsl, seq_lens = make_step(MIXES[mix], heads, kv_heads, head_dim, block_size, dtype)
    rotary = RotaryEmbedding(head_dim, 512, 10000.0)
    scale = head_dim ** -0.5
    want, want_k, want_v = reference_attention(qkv, k_cache, v_cache, table, qsl, seq_lens, rotary, heads, kv_heads,
                                               head_dim, scale, window)
    out = torch.full((qkv.shape[0], heads * head_dim), float("nan"), dtype=dtype)
    cos_sin = rotary.cos_sin.flatten(1).contiguous()
    q, k, v = split_heads(qkv, heads, kv_heads, head_dim)
    kc, vc = head_major(k_cache), head_major(v_cache)
    kernels.attention(q, k, v, kc, vc, table, qsl, seq_lens, cos_sin, out.view(-1, heads, head_dim), scale,
                      window=window)
    torch.testing.assert_close(head_major(kc).float(), want_k.float(), **TOL[dtype])
    torch.testing.assert_close(head_major(vc), want_v)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (8, 1, 32)])
@pytest.mark.parametrize("window", [5, 40])
@pytest.mark.parametrize("mix", ["decodes", "chunks_with_context", "mixed"])
def test_attention_with_sliding_window_matches_torch(kernels, dtype, block_size, heads, kv_heads, head_dim, window,
                                                     mix):
    """Each query sees its last ``window`` keys: decode items start at the window, prompt tiles mask each row's
    keys before it (the tiles of 8 query heads a kv head hold few queries, 16 heads' many)."""
    if not kernels.supports(dtype, head_dim):
        pytest.skip(f"head_dim {head_dim} is not a multiple of this level's vector width: the torch path")
    check_attention(kernels, dtype, block_size, heads, kv_heads, head_dim, mix, window)


def test_window_with_eviction_inputs_is_refused(kernels):
    """Windows count positions: with rope offsets (KV eviction shifted the slots) a windowed call is refused."""
    heads, kv_heads, d = 4, 4, 64
    qkv, k_cache, v_cache, table, qsl, seq_lens = make_step([(10, 1)], heads, kv_heads, d, 16, torch.float32)
    q, k, v = split_heads(qkv, heads, kv_heads, d)
    out = torch.empty(1, heads, d)
    cos_sin = RotaryEmbedding(d, 512, 10000.0).cos_sin.flatten(1).contiguous()
    from conveyor.kernels.cpu_ops import KernelError

    with pytest.raises(KernelError, match="bad argument"):
        kernels.attention(q, k, v, head_major(k_cache), head_major(v_cache), table, qsl, seq_lens, cos_sin, out, 0.1,
                          rope_offset=torch.zeros(1, dtype=torch.int64), window=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_attention_without_rope_and_with_strided_rows(kernels, dtype):
    """GPT-2 style (no rope), q/k/v rows inside a wider buffer, out rows inside a wider buffer."""
    heads, kv_heads, d = 4, 4, 64
    qkv, k_cache, v_cache, table, qsl, seq_lens = make_step([(10, 1), (0, 12), (20, 3)], heads, kv_heads, d, 16, dtype)
    wide = torch.zeros(qkv.shape[0], qkv.shape[1] + 40, dtype=dtype)
    wide[:, :qkv.shape[1]] = qkv
    want, want_k, _ = reference_attention(qkv, k_cache, v_cache, table, qsl, seq_lens, None, heads, kv_heads, d, 0.1)
    out = torch.zeros(qkv.shape[0], heads * d + 8, dtype=dtype)
    q, k, v = split_heads(wide, heads, kv_heads, d)
    kc, vc = head_major(k_cache), head_major(v_cache)
    kernels.attention(q, k, v, kc, vc, table, qsl, seq_lens, None, out[:, :heads * d].view(-1, heads, d), 0.1)
    torch.testing.assert_close(out[:, :heads * d].float(), want, **TOL[dtype])
    assert (out[:, heads * d:] == 0).all()  # nothing written past a row's H * D values
    torch.testing.assert_close(head_major(kc), want_k.to(dtype))


def test_attention_long_context_is_stable(kernels):
    """Large scores over many chunks: the online softmax must neither overflow nor lose the early keys."""
    heads, kv_heads, d = 8, 2, 64
    qkv, k_cache, v_cache, table, qsl, seq_lens = make_step([(1500, 1), (900, 40)], heads, kv_heads, d, 16,
                                                            torch.float32)
    k_cache *= 6  # scores of order 100: exp() overflows without the running max
    want, *_ = reference_attention(qkv, k_cache, v_cache, table, qsl, seq_lens, None, heads, kv_heads, d, 1.0)
    out = torch.empty(qkv.shape[0], heads * d)
    q, k, v = split_heads(qkv, heads, kv_heads, d)
    kernels.attention(q, k, v, head_major(k_cache), head_major(v_cache), table, qsl, seq_lens, None,
                      out.view(-1, heads, d), 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def check_prefill_paths_agree(kernels, switch, reqs, heads, kv_heads, head_dim, block_size, window=0):
    """bfloat16 prefill attention with ``switch(True)`` and ``switch(False)`` (a fast path on and off), each
    against torch, and the two against each other, on a cache whose never-written slots hold NaN (keys past a
    request's end must be masked or read as zeros, not merely small). Returns the two outputs."""
    qkv, k_cache, v_cache, table, qsl, seq_lens = make_step(reqs, heads, kv_heads, head_dim, block_size,
                                                            torch.bfloat16)
    for row, (computed, new) in zip(table, reqs):  # slots after each request's last token: unwritten
        last_block, used = row[(computed + new - 1) // block_size], (computed + new - 1) % block_size + 1
        k_cache[last_block, used:] = float("nan")
        v_cache[last_block, used:] = float("nan")
    rotary = RotaryEmbedding(head_dim, 512, 10000.0)
    scale = head_dim ** -0.5
    want, *_ = reference_attention(qkv, k_cache, v_cache, table, qsl, seq_lens, rotary, heads, kv_heads,
                                   head_dim, scale, window=window)
    outs = []
    for on in (True, False):
        switch(on)
        out = torch.empty(qkv.shape[0], heads * head_dim, dtype=torch.bfloat16)
        q, k, v = split_heads(qkv.clone(), heads, kv_heads, head_dim)
        kernels.attention(q, k, v, head_major(k_cache), head_major(v_cache), table, qsl, seq_lens,
                          rotary.cos_sin.flatten(1).contiguous(), out.view(-1, heads, head_dim), scale,
                          window=window)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), want, **TOL[torch.bfloat16])
        outs.append(out.float())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)  # the two paths agree
    return outs


@pytest.mark.parametrize("block_size", [16, 32, 8])  # 8: a key tile (16 keys) spans blocks, so no AMX
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (9, 3, 64), (4, 2, 128), (8, 8, 64)])
def test_prefill_attention_on_amx_tiles(kernels, block_size, heads, kv_heads, head_dim):
    """bfloat16 prefill chunks whose QK^T runs on AMX tiles (where the CPU has them) against torch and against the
    vector path: AMX loads whole 16-key tiles, so unwritten slots' NaN must be masked."""
    if not kernels.set_amx_attention(True):
        pytest.skip("no AMX here (or not this build level): the vector path is what runs, tested above")
    dot_was = kernels.set_dot_attention(False)  # AMX off: the float32 FMA loop
    try:
        reqs = [(0, 70), (40, 45), (0, 1), (16, 16), (5, 9), (0, 33), (100, 3), (3, 1)]
        check_prefill_paths_agree(kernels, kernels.set_amx_attention, reqs, heads, kv_heads, head_dim, block_size)
    finally:
        kernels.set_amx_attention(True)
        kernels.set_dot_attention(dot_was)


@pytest.mark.parametrize("block_size", [16, 8, 1])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(9, 3, 64, 0), (4, 2, 128, 0), (8, 8, 64, 0),
                                                             (6, 2, 64, 20)])
def test_prefill_attention_on_vdpbf16ps(kernels, block_size, heads, kv_heads, head_dim, window):
    """bfloat16 prefill tiles on VDPBF16PS (avx512bf16 without AMX tiles: q and probabilities in pairs, K pairs
    broadcast, V in key pairs) against torch and against the float32 FMA loop, with NaN in unwritten slots (a
    chunk's keys past the end read zero rows), odd key counts and a sliding window."""
    amx_was = kernels.set_amx_attention(False)
    if not kernels.set_dot_attention(True):
        kernels.set_amx_attention(amx_was)
        pytest.skip("below the avx512bf16 level: no VDPBF16PS path (the FMA loop is tested above)")
    try:
        reqs = [(0, 70), (40, 45), (0, 1), (16, 16), (5, 9), (0, 33), (100, 3), (3, 1), (0, 7)]
        dot, fma = check_prefill_paths_agree(kernels, kernels.set_dot_attention, reqs, heads, kv_heads, head_dim,
                                             block_size, window)
        assert not torch.equal(dot, fma)  # the switch did change the path
    finally:
        kernels.set_dot_attention(True)
        kernels.set_amx_attention(amx_was)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden", [64, 576, 517])
def test_add_rmsnorm_matches_torch(kernels, dtype, hidden):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(70, hidden, generator=gen).to(dtype)
    res = torch.randn(70, hidden, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    want_res = (x.float() + res.float()).to(dtype)
    h = want_res.float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)  # HF's order
    out = torch.empty_like(x)
    got_res = res.clone()
    kernels.add_rmsnorm(x, got_res, w, 1e-5, out)
    torch.testing.assert_close(got_res, want_res)
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    out2 = torch.empty_like(x)
    kernels.add_rmsnorm(want_res, None, w, 1e-5, out2)  # no residual: plain RMSNorm
    torch.testing.assert_close(out2, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1408, 37])
def test_silu_mul_matches_torch(kernels, dtype, n):
    gu = (3 * torch.randn(9, 2 * n, generator=torch.Generator().manual_seed(2))).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturating sigmoid: no NaN, no inf
    want = (F.silu(gu[:, :n].float()) * gu[:, n:].float())
    out = torch.empty(9, n, dtype=dtype)
    kernels.silu_mul(gu, out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [49152, 1000, 37, 5])
def test_argmax_rows_matches_numpy(kernels, dtype, n):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, n + 3, generator=g).to(dtype)[:, :n]  # strided rows: a row stride past its width
    x[1, :] = 0.0
    x[1, n // 2] = x[1, n - 1] = 5.0                          # a tie: the first maximum wins
    x[2, :] = float("-inf")                                   # all -inf: index 0
    x[3, n - 1] = float("inf")                                # the maximum in the scalar tail (n % 16)
    x[4, n // 3] = float("nan")
    x[4, n - 1] = float("nan")                                # NaN counts as the maximum, the first NaN wins
    x[5, :] = x[5, :].abs().neg()
    x[5, n - 1] = -0.0                                        # -0.0 and 0.0 are equal maxima
    x[5, 0] = 0.0
    want = torch.from_numpy(x.float().numpy().argmax(axis=-1))
    got = kernels.argmax_rows(x)
    assert got.dtype == torch.int64
    assert got.tolist() == want.tolist()
    assert got[1].item() == n // 2 and got[2].item() == 0 and got[4].item() == n // 3 and got[5].item() == 0


def test_bf16_rounding_matches_torch(kernels):
    """The kernels round float32 to bfloat16 to nearest even, as torch does; inf and NaN survive. The residual
    add of two bfloat16 values is exact in float32, so its stored result shows the rounding alone."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(1, 4096, generator=gen) * torch.logspace(-3, 3, 4096)).to(torch.bfloat16)
    res = (torch.randn(1, 4096, generator=gen) * 7).to(torch.bfloat16)
    x[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.0e38])
    res[0, 3] = 3.0e38  # overflows to inf
    want = (x.float() + res.float()).to(torch.bfloat16)
    got = res.clone()
    kernels.add_rmsnorm(x, got, torch.ones(4096, dtype=torch.bfloat16), 1e-5, torch.empty_like(x))
    torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 32, 41, 96, 113, 128])
@pytest.mark.parametrize("out_features,in_features", [(96, 80), (1000, 512), (17, 6)])
def test_skinny_gemm_matches_torch(kernels, dtype, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x_wide = torch.randn(rows, in_features + 3, generator=gen).to(dtype)
    x = x_wide[:, :in_features]  # rows of x need not be contiguous with each other
    packed = kernels.pack_skinny_weight(w)
    for b in (None, bias):
        out = torch.full((rows, out_features), float("nan"), dtype=dtype)
        kernels.skinny_linear(x, packed, b, out_features, out)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=2e-2)
        torch.testing.assert_close(out.double(), want, **tol)


def test_skinny_gemm_float32_rows_do_not_depend_on_the_batch(kernels):
    """Past one row tile float32 takes the k-blocked loop (x packed, W in L1-sized chunks); every output still sums
    k in order in one accumulator, so a row's result is bitwise the same alone as in a batch of 41."""
    gen = torch.Generator().manual_seed(5)
    w, bias = torch.randn(1000, 700, generator=gen), torch.randn(1000, generator=gen)
    x = torch.randn(41, 700, generator=gen)
    packed = kernels.pack_skinny_weight(w)
    batch = torch.empty(41, 1000)
    kernels.skinny_linear(x, packed, bias, 1000, batch)
    for r in (0, 8, 40):
        alone = torch.empty(1, 1000)
        kernels.skinny_linear(x[r:r + 1], packed, bias, 1000, alone)
        assert torch.equal(alone[0], batch[r])


@pytest.mark.parametrize("out_features", [1000, 96])  # units of four blocks past 8 rows; pairs (too few quads)
def test_skinny_gemm_bfloat16_rows_do_not_depend_on_the_batch(kernels, out_features):
    """bfloat16 on VDPBF16PS (avx512bf16) keeps each output's sum over k in one accumulator in order at every row
    count, so a row's result is bitwise the same alone as in a batch of 41 (decode steps and speculative
    verification then agree); the emulated loop of the lower levels too."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(out_features, 700, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(41, 700, generator=gen).to(torch.bfloat16)
    packed = kernels.pack_skinny_weight(w)
    batch = torch.empty(41, out_features, dtype=torch.bfloat16)
    kernels.skinny_linear(x, packed, bias, out_features, batch)
    for r in (0, 8, 40):
        alone = torch.empty(1, out_features, dtype=torch.bfloat16)
        kernels.skinny_linear(x[r:r + 1], packed, bias, out_features, alone)
        assert torch.equal(alone[0], batch[r])


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 33, 96, 128])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (1000, 512), (17, 32)])
def test_amx_gemm_matches_torch(kernels, rows, out_features, in_features):
    """bfloat16 on AMX tiles, where the CPU has them (rows crossing the 16-row tile and 32-row pair edges)."""
    if not kernels.amx:
        pytest.skip("no AMX at this level / on this CPU")
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    w = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_features + 32, generator=gen).to(torch.bfloat16)[:, :in_features]
    packed = kernels.pack_skinny_weight(w)
    for b in (None, bias):
        out = torch.full((rows, out_features), float("nan"), dtype=torch.bfloat16)
        kernels.amx_linear(x, packed, b, out_features, out)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(out.double(), want, atol=0.1, rtol=2e-2)


def test_struct_mirrors_match_the_c_layout(kernels):
    """Every ctypes mirror matches its C struct field by field (the load checks it too); a mirror that differs,
    here a C layout with two int64 fields swapped, fails the check instead of passing garbage."""
    import ctypes

    from conveyor.kernels.build import BuildError
    from conveyor.kernels.cpu_ops import check_abi

    lib = ctypes.CDLL(kernels.path)
    check_abi(lib, kernels.path)

    class Swapped:  # the real library, except that CvkAttnArgs has q_stride and k_stride swapped
        cvk_abi_version = staticmethod(lib.cvk_abi_version)

        class cvk_struct_layout:
            restype = argtypes = None

            def __new__(cls, which):
                text = lib.cvk_struct_layout(which).decode()
                if which == 0:
                    text = text.replace("q_stride:", "tmp:").replace("k_stride:", "q_stride:").replace("tmp:",
                                                                                                       "k_stride:")
                return text.encode()

    with pytest.raises(BuildError, match="AttnArgs layout differs"):
        check_abi(Swapped, "swapped")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_attention_plan_built_once_serves_every_layer(kernels, dtype):
    """One plan per step, passed to every layer's call: the same results as calls that plan for themselves; a
    plan built for another step (other requests or heads) is refused, not misread."""
    from conveyor.kernels.cpu_ops import KernelError

    heads, kv_heads, d = 8, 2, 64
    reqs = MIXES["mixed"]
    qkv, k_cache, v_cache, table, qsl, seq_lens = make_step(reqs, heads, kv_heads, d, 16, dtype)
    cos_sin = RotaryEmbedding(d, 512, 10000.0).cos_sin.flatten(1).contiguous()
    plan = kernels.attention_plan(qsl, seq_lens, heads, kv_heads, d)
    outs = []
    for layer_plan in (None, plan, plan):  # layers 1 and 2 reuse the one plan
        out = torch.empty(qkv.shape[0], heads, d, dtype=dtype)
        q, k, v = split_heads(qkv.clone(), heads, kv_heads, d)
        kc, vc = head_major(k_cache), head_major(v_cache)
        kernels.attention(q, k, v, kc, vc, table, qsl, seq_lens, cos_sin, out, d ** -0.5, plan=layer_plan)
        outs.append((out, kc))
    for out, kc in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(kc, outs[0][1])
    other = kernels.attention_plan(qsl[:3], seq_lens[:2], heads, kv_heads, d)
    for bad in (other, kernels.attention_plan(qsl, seq_lens, heads, 4, d)):
        q, k, v = split_heads(qkv.clone(), heads, kv_heads, d)
        with pytest.raises(KernelError, match="-3"):
            kernels.attention(q, k, v, head_major(k_cache), head_major(v_cache), table, qsl, seq_lens, cos_sin,
                              torch.empty(qkv.shape[0], heads, d, dtype=dtype), d ** -0.5, plan=bad)
