"""The encoder's bidirectional attention over packed sequences (csrc/encoder_attention.cpp) against torch's SDPA
run on each sequence alone, at every instruction-set level this CPU runs: ragged lengths (1 token, a sequence longer
than one key block of 512), head sizes 32 (MiniLM) and 64 (BERT-base / BGE), float32 and bfloat16, q, k and v as
views of one fused qkv buffer as the encoder passes them; and ``packed_attention``'s torch path against the kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels.cpu_ops import KernelError
from conveyor.layers.attention.packed import PackedSequences, packed_attention

TOL = {torch.float32: 4e-6, torch.bfloat16: 6e-3}  # of the largest |output|; bfloat16: its rounding (torch: the same)


def _packed(lengths, heads, head_dim, dtype, pad_rows=3, seed=0):
    """qkv [rows, 3, H, D] for sequences of ``lengths`` back to back, then ``pad_rows`` rows of no sequence."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(starts[-1] + pad_rows, 3, heads, head_dim, generator=g).mul(1.5).to(dtype)
    return qkv, PackedSequences.of(starts)


def _reference(qkv, starts, kv_heads=None):
    """Each sequence through SDPA alone, in float32 from the same (rounded) inputs."""
    heads = qkv.shape[2]
    out = torch.zeros(qkv.shape[0], heads, qkv.shape[3])
    for s, e in zip(starts[:-1], starts[1:]):
        q, k, v = (t.float().transpose(0, 1) for t in qkv[s:e].unbind(1))  # [H, L, D]
        if kv_heads is not None:  # grouped: query head h reads kv head h // (H / KVH)
            k, v = (t[:kv_heads].repeat_interleave(heads // kv_heads, 0) for t in (k, v))
        out[s:e] = F.scaled_dot_product_attention(q, k, v).transpose(0, 1)
    return out


def _assert_close(got, ref, dtype):
    tol = TOL[dtype]
    err = (got.float() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), f"max error {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads", [(32, 12), (64, 4), (48, 2)])
def test_ragged_sequences_equal_sdpa_per_sequence(kernels, dtype, head_dim, heads):
    lengths = [1, 7, 16, 33, 130, 2, 600, 250]  # 600: two key blocks (the online softmax across them)
    qkv, seqs = _packed(lengths, heads, head_dim, dtype)
    out = torch.full((qkv.shape[0], heads, head_dim), 7.0, dtype=dtype)
    q, k, v = qkv.unbind(1)
    kernels.encoder.run(q, k, v, out, seqs.cu_seqlens, head_dim ** -0.5)
    end = seqs.starts[-1]
    _assert_close(out[:end], _reference(qkv, seqs.starts)[:end], dtype)
    assert torch.all(out[end:] == 7.0)  # rows of no sequence are not written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_sequence_split_over_query_tiles_and_grouped_heads(kernels, dtype):
    # one sequence of one kv head: too few (sequence, head) pairs for the threads, so its queries are split
    for lengths, heads, kv_heads in (([300], 1, 1), ([45, 1], 4, 2)):
        qkv, seqs = _packed(lengths, heads, 32, dtype, pad_rows=0, seed=1)
        q, k, v = qkv.unbind(1)
        out = torch.empty(qkv.shape[0], heads, 32, dtype=dtype)
        kernels.encoder.run(q, k[:, :kv_heads], v[:, :kv_heads], out, seqs.cu_seqlens, 32 ** -0.5)
        _assert_close(out, _reference(qkv, seqs.starts, kv_heads), dtype)


def test_refuses_what_it_cannot_compute(kernels):
    qkv, seqs = _packed([5, 3], 2, 24, torch.float32)
    q, k, v = qkv.unbind(1)
    assert not kernels.encoder.supports(torch.float32, 2, 2, 24) and not kernels.encoder.supports(torch.float16, 2, 2, 32)
    with pytest.raises(KernelError, match="unsupported"):  # a head size that is not a multiple of 16
        kernels.encoder.run(q, k, v, torch.empty(q.shape), seqs.cu_seqlens, 1.0)
    with pytest.raises(ValueError, match="past the rows"):
        kernels.encoder.run(q[:4], k[:4], v[:4], torch.empty(q[:4].shape), seqs.cu_seqlens, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attention_torch_path_equals_the_kernel(kernels, dtype):
    qkv, seqs = _packed([3, 40, 1, 77], 6, 32, dtype, seed=2)
    outs = []
    for k in (kernels, None):
        out = torch.zeros(qkv.shape[0], 6, 32, dtype=dtype)
        packed_attention(qkv, out, seqs, k)
        outs.append(out.float())
    _assert_close(outs[0], outs[1], dtype)
    # a layout the kernel does not serve takes the torch path with the kernels given
    qkv16, _ = _packed([3, 40, 1, 77], 6, 32, torch.float16, seed=2)
    out16 = torch.zeros(qkv16.shape[0], 6, 32, dtype=torch.float16)
    packed_attention(qkv16, out16, seqs, kernels)
    assert (out16.float()[:121] - _reference(qkv16, seqs.starts)[:121]).abs().max().item() < 5e-3
