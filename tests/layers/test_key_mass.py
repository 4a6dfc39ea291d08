"""Attention mass per block for KV eviction by score, from KeyMassAttention (the torch side pass around a backend)
and from the native kernels themselves: the step's output is unchanged, and the mass per block equals a plain
softmax over each request's keys, in both cache layouts (token-major, head-major)."""

from __future__ import annotations

import pytest
import torch

from conveyor.layers.attention import KeyMassAttention, backend_class, make_attention
from conveyor.layers.attention.kv_layout import HEAD_MAJOR
from conveyor.layers.attention.common import gather_context
from conveyor.layers.attention.native_cpu import NativeCpuAttention
from tests.layers.test_attention import HEAD_DIM, HEADS, KV_HEADS, make_step


def expected_mass(meta, q, cache, i, rows, scale):
    """Softmax of request i's last ``rows`` queries over its keys, summed over heads and rows, per block."""
    bs = meta.block_size
    end, seq_len = meta.query_start_loc[i + 1], meta.seq_lens[i]
    keys, _ = gather_context(cache, meta.block_table[i], seq_len)  # token-major [L, KVH, d]
    group = HEADS // KV_HEADS
    kh = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, L, d]
    total = torch.zeros(seq_len)
    for r in range(end - rows, end):
        slot = seq_len - (end - r)
        w = (q[r].unsqueeze(1) * kh[:, :slot + 1]).sum(-1) * scale  # [H, slot + 1]
        total[:slot + 1] += w.softmax(-1).sum(0)
    nb = -(-seq_len // bs)
    return torch.nn.functional.pad(total, (0, nb * bs - seq_len)).view(nb, bs).sum(-1)


def to_head_major(cache):
    return cache.permute(0, 1, 3, 2, 4).contiguous()


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("backend", ["reference", "cpu-torch", "cpu-native"])
def test_mass_matches_plain_softmax_and_output_is_unchanged(backend, block_size):
    if backend == "cpu-native":
        from conveyor.kernels import load_cpu_kernels

        kernels = load_cpu_kernels()
        if kernels is None or not kernels.supports(torch.float32, HEAD_DIM):
            pytest.skip("native kernels not built here")
    reqs = [(40, 1), (3, 1), (0, 20), (17, 5), (100, 1), (64, 30)]
    meta, _, q, k, v, cache = make_step(block_size, reqs, seed=3)
    scale = 0.25
    # the sorted order of make_step: decodes first (by context), then the chunks
    scored = {0: 1, 2: 1, 3: 20, 5: 7}
    head_major = backend_class(backend).kv_layout is HEAD_MAJOR
    layout = to_head_major if head_major else (lambda c: c)
    plain_out = make_attention(backend, meta, torch.float32).forward(q.clone(), k, v, layout(cache.clone()), scale)
    wrapped = make_attention(backend, meta, torch.float32, scored=scored)
    if backend == "cpu-native":  # scored in its own kernels: the layer stack still runs the step
        assert isinstance(wrapped, NativeCpuAttention) and wrapped.supports_layer_stack
    else:
        assert isinstance(wrapped, KeyMassAttention) and not wrapped.supports_layer_stack
    written = layout(cache.clone())
    out = wrapped.forward(q.clone(), k, v, written, scale)
    out = wrapped.forward(q.clone(), k, v, written, scale)  # a second "layer": the masses add up
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)
    masses = wrapped.block_scores()
    assert set(masses) == set(scored)
    token_major = written.permute(0, 1, 3, 2, 4) if head_major else written
    for i, rows in scored.items():
        want = 2 * expected_mass(meta, q, token_major, i, rows, scale)
        torch.testing.assert_close(torch.tensor(masses[i]), want, rtol=1e-4, atol=1e-4)
        # each scored row spreads one unit of mass per head over its keys
        assert sum(masses[i]) == pytest.approx(2 * HEADS * rows, rel=1e-4)


def test_no_scores_no_wrapper():
    meta, _, q, k, v, cache = make_step(4, [(5, 1)], seed=1)
    assert not isinstance(make_attention("reference", meta, torch.float32, scored={}), KeyMassAttention)
