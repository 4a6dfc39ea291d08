"""The quantized weights and their GEMM: every GGUF format's repacking against the ``gguf`` package's own
dequantization (bit for bit), and the native integer GEMM at every instruction-set level this CPU runs against a
dequantize-then-matmul reference, for row counts 1-256 (rows not a multiple of the register tile included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from conveyor.layers.gguf_blocks import GGUF_KERNEL_TYPES, from_gguf
from conveyor.layers.quantized import QuantEmbedding, QuantizedStack, QuantizedTensor, QuantLinear, quantize_int8

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # the gguf package writes these itself
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")  # written here as random blocks with sane scales


def gguf_bytes(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """A [n, k] tensor's stored bytes in ``qtype``."""
    rng = np.random.default_rng(seed)
    qt = GGMLQuantizationType[qtype]
    if qtype in QUANTIZABLE:
        return gq.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1, qt).reshape(-1)
    block, size = GGML_QUANT_SIZES[qt]
    blocks = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    nblocks = blocks.shape[0]
    if qtype == "Q6_K":  # ql, qh, 16 int8 sub-scales (any), then d
        blocks[:, 208:210] = rng.uniform(0.0001, 0.001, nblocks).astype(np.float16).view(np.uint8).reshape(nblocks, 2)
        return blocks.reshape(-1)
    blocks[:, 0:2] = rng.uniform(0.001, 0.01, nblocks).astype(np.float16).view(np.uint8).reshape(nblocks, 2)  # d
    blocks[:, 2:4] = rng.uniform(0.001, 0.01, nblocks).astype(np.float16).view(np.uint8).reshape(nblocks, 2)  # dmin
    return blocks.reshape(-1)


def reference_dequant(raw: np.ndarray, qtype: str, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gq.dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("qtype", GGUF_KERNEL_TYPES)
@pytest.mark.parametrize("k", [256, 576, 1536])
def test_repacked_gguf_dequantizes_as_the_gguf_package(qtype, k):
    n = 24
    if qtype == "Q6_K" and k % 256:
        pytest.skip("Q6_K rows hold whole super-blocks of 256")
    raw = gguf_bytes(qtype, n, k, seed=k)
    qt = from_gguf(raw, qtype, (n, k))
    assert qt is not None and qt.shape == (n, k) and qt.source == qtype
    assert qt.kind == {"Q4": "q4", "Q5": "q5", "Q6": "q6", "Q8": "q8"}[qtype[:2]]
    torch.testing.assert_close(qt.dequantize(), reference_dequant(raw, qtype, n, k), atol=1e-6, rtol=1e-6)


def test_types_without_a_kernel_are_left_to_dequantization():
    assert from_gguf(np.zeros(136, np.uint8), "IQ4_XS", (1, 256)) is None
    assert from_gguf(np.zeros(64, np.uint8), "F32", (4, 4)) is None


def emulate(x: torch.Tensor, qt: QuantizedTensor | QuantizedStack) -> torch.Tensor:
    """What the kernel computes, in float64: x quantized per block of 32 to integers of 15 bits (unit max |x| /
    32385, round half to even, in float32 as the kernel rounds), integer dot products per weight block (32
    values, or Q6_K's 16), scaled by both scales, plus the offsets against d * sum(n) over the block."""
    if isinstance(qt, QuantizedStack):
        return torch.cat([emulate(x, p) for p in qt.parts], dim=1)
    m, k = x.shape
    kp = -(-k // 32) * 32
    xp = torch.nn.functional.pad(x.to(torch.float32), (0, kp - k)).view(m, -1, 32)
    amax = xp.abs().amax(-1, keepdim=True)
    d = (amax / 32385).double().expand(m, kp // 32, 32 // qt.block).reshape(m, -1)
    q = torch.round(xp * torch.where(amax > 0, 32385 / amax, 0.0)).to(torch.float64).view(m, -1, qt.block)
    wq = torch.nn.functional.pad(qt.q, (0, kp - k)).view(qt.shape[0], -1, qt.block).to(torch.float64)
    dots = torch.einsum("mjc,njc->mnj", q, wq)
    y = (dots * d[:, None, :] * qt.scale.double()[None]).sum(-1)
    return y + ((d * q.sum(-1))[:, None, :] * qt.offset.double()[None]).sum(-1)


def weights_of_every_kind(n: int, k: int):
    for qtype in GGUF_KERNEL_TYPES:
        if k % 256 and qtype in KQUANTS:
            continue
        yield qtype, from_gguf(gguf_bytes(qtype, n, k, seed=n + k), qtype, (n, k))
    gen = torch.Generator().manual_seed(k)
    yield "int8", quantize_int8(torch.randn(n, k, generator=gen) * 0.05)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 33, 128, 256])
@pytest.mark.parametrize("n,k", [(40, 256), (21, 576), (8, 96)])
def test_quant_gemm_matches_the_integer_reference(kernels, rows, n, k):
    """float32 activations: the kernel equals the exact integer emulation to float32 rounding, and the float
    matmul on the dequantized weight to the activations' 15-bit quantization error (1e-4 of the result: 8-bit
    activations, as llama.cpp's, would be 1e-2)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    for name, qt in weights_of_every_kind(n, k):
        out = torch.empty(rows, n)
        packed = qt.pack()
        kernels.quant_linear(x, packed.descriptor(), bias, out)
        want = emulate(x, qt) + bias.double()
        # float32 sums of per-block terms whose offsets cancel: exact to a few 1e-6 of the outputs' scale
        scale = want.abs().max().item()
        torch.testing.assert_close(out.double(), want, atol=2e-5 * scale, rtol=1e-5, msg=f"{name} at {kernels.level}")
        exact = x.double() @ qt.dequantize().double().t() + bias.double()
        err = (out.double() - exact).norm() / exact.norm()
        assert err < 1e-3, f"{name}: relative error {err:.6f} against the float matmul"


@pytest.mark.parametrize("rows", [1, 6])
def test_quant_gemm_bfloat16_activations(kernels, rows):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    for name, qt in weights_of_every_kind(33, 576):
        out = torch.empty(rows, 33, dtype=torch.bfloat16)
        packed = qt.pack()
        kernels.quant_linear(x, packed.descriptor(), None, out)
        torch.testing.assert_close(out.double(), emulate(x.float(), qt), atol=2e-2, rtol=2e-2, msg=name)


def test_quant_gemm_reads_strided_rows_and_writes_strided_outputs(kernels):
    qt = from_gguf(gguf_bytes("Q4_1", 16, 256), "Q4_1", (16, 256))
    x = torch.randn(5, 300)[:, :256]
    out = torch.zeros(5, 20)
    packed = qt.pack()
    kernels.quant_linear(x, packed.descriptor(), None, out[:, :16])
    torch.testing.assert_close(out[:, :16].double(), emulate(x, qt), atol=1e-4, rtol=1e-4)
    assert out[:, 16:].abs().sum() == 0


@pytest.fixture
def amx_kernels(kernels):
    """The kernels where the quantized GEMM can run on AMX-INT8 tiles (Sapphire Rapids and later, avx512bf16
    level); the setting is put back after the test."""
    if not kernels.amx_int8:
        pytest.skip(f"no AMX-INT8 at the {kernels.level} level on this CPU")
    yield kernels
    kernels.set_amx_qdot(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_int8_computes_the_vnni_loops_numbers_bit_for_bit(amx_kernels, dtype):
    """The tiles' integer products and the VNNI loop's are the same integers, and the epilogue applies the
    block scales in the same float operations: equal outputs for every format and row count (tiles of 8 rows,
    partial ones included), so a verifying step of several rows computes what a one-row decode step does."""
    gen = torch.Generator().manual_seed(3)
    for n, k in [(40, 256), (21, 576), (8, 96)]:
        for name, qt in weights_of_every_kind(n, k):
            packed = qt.pack()
            bias = torch.randn(n, generator=gen).to(dtype)
            for rows in [1, 5, 8, 9, 16, 17, 33, 130]:
                x = torch.randn(rows, k, generator=gen).to(dtype)
                outs = []
                for on in (False, True):
                    assert amx_kernels.set_amx_qdot(on, min_rows=1) is on
                    out = torch.empty(rows, n, dtype=dtype)
                    amx_kernels.quant_linear(x, packed.descriptor(), bias, out)
                    outs.append(out)
                assert torch.equal(outs[0], outs[1]), f"{name}, {rows} rows, {dtype}"


def test_amx_int8_switch_scratch_and_strided_rows(amx_kernels):
    """The switch answers what it set; the scratch a step needs grows by the packed tiles only while the tiles
    are on for its row count; strided rows and a strided output on the tiles."""
    qt = from_gguf(gguf_bytes("Q4_1", 16, 256), "Q4_1", (16, 256))
    packed = qt.pack()
    assert amx_kernels.set_amx_qdot(True) and not amx_kernels.set_amx_qdot(False)
    vnni_bytes = amx_kernels.quant_scratch_bytes(20, 256)
    amx_kernels.set_amx_qdot(True, min_rows=21)
    assert amx_kernels.quant_scratch_bytes(20, 256) == vnni_bytes
    amx_kernels.set_amx_qdot(True, min_rows=1)
    assert amx_kernels.quant_scratch_bytes(20, 256) > vnni_bytes
    amx_kernels.set_amx_qdot(True)  # the defaults: 8-bit weights take the tiles from 3 rows, 4-bit from 5
    row = amx_kernels.quant_scratch_bytes(1, 256)
    assert amx_kernels.quant_scratch_bytes(2, 256) == 2 * row  # rows only: no kind takes the tiles yet
    assert amx_kernels.quant_scratch_bytes(3, 256) > 3 * row  # tiles packed: an 8-bit weight takes them
    x = torch.randn(20, 300)[:, :256]
    out = torch.zeros(20, 24)
    amx_kernels.quant_linear(x, packed.descriptor(), None, out[:, :16])
    torch.testing.assert_close(out[:, :16].double(), emulate(x, qt), atol=1e-4, rtol=1e-4)
    assert out[:, 16:].abs().sum() == 0


def test_amx_int8_is_never_on_below_the_avx512bf16_level():
    from conveyor.kernels.cpu_features import LEVELS, cpu_features
    from conveyor.kernels.cpu_ops import load_cpu_kernels

    for level in ("avx2", "avx512"):
        if LEVELS.index(level) > LEVELS.index(cpu_features().native_level):
            continue
        k = load_cpu_kernels(level)
        if k is not None:
            assert not k.amx_int8 and not k.set_amx_qdot(True, min_rows=1), level


def test_dequantize_kernel_matches_torch(kernels):
    for name, qt in weights_of_every_kind(19, 576):
        full = torch.empty(19, 576)
        packed = qt.pack()
        kernels.quant_dequantize(packed.descriptor(), None, full)
        # scale * q + offset may be one fused multiply-add in the kernel and two roundings in torch: one ulp apart
        reference = qt.dequantize()
        ulp = reference.abs().max().item() * 2.0**-23
        torch.testing.assert_close(full, reference, atol=2 * ulp, rtol=0, msg=name)
        rows = torch.tensor([3, 0, 18, 3])
        picked = torch.empty(4, 576, dtype=torch.bfloat16)
        kernels.quant_dequantize(packed.descriptor(), rows, picked)
        torch.testing.assert_close(picked.float(), full[rows].to(torch.bfloat16).float(), atol=0, rtol=0, msg=name)


def test_dequantize_rejects_a_row_out_of_range(kernels):
    from conveyor.kernels.cpu_ops import KernelError

    packed = quantize_int8(torch.randn(4, 64)).pack()
    with pytest.raises(KernelError, match="bad argument"):
        kernels.quant_dequantize(packed.descriptor(), torch.tensor([4]), torch.empty(1, 64))


def test_quant_linear_switches_to_the_float_gemm_above_its_row_limit(kernels):
    """Above ``max_rows`` the layer dequantizes and runs the float GEMM: exact against the dequantized weight,
    and within the activation quantization error of the integer path."""
    qt = from_gguf(gguf_bytes("Q4_K", 64, 512), "Q4_K", (64, 512))
    layer = QuantLinear(qt, torch.randn(64), kernels, torch.float32)
    x = torch.randn(200, 512)
    layer.max_rows = 128
    big = layer(x)
    torch.testing.assert_close(big, x @ qt.dequantize().t() + layer.bias, atol=1e-4, rtol=1e-4)
    layer.max_rows = 256
    small = layer(x)
    assert (small - big).norm() / big.norm() < 0.02


def test_quant_embedding_looks_up_dequantized_rows(kernels):
    qt = from_gguf(gguf_bytes("Q8_0", 50, 64), "Q8_0", (50, 64))
    emb = QuantEmbedding(qt, kernels, torch.float32)
    ids = torch.tensor([[1, 49], [0, 1]])
    torch.testing.assert_close(emb(ids), qt.dequantize()[ids], atol=0, rtol=0)


def test_fusing_and_permuting_rows_keeps_values():
    a = from_gguf(gguf_bytes("Q4_1", 8, 64, seed=1), "Q4_1", (8, 64))
    b = from_gguf(gguf_bytes("Q4_0", 4, 64, seed=2), "Q4_0", (4, 64))
    fused = QuantizedTensor.cat([a, b])
    torch.testing.assert_close(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    perm = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4, 8, 9, 11, 10])
    torch.testing.assert_close(fused.take_rows(perm).dequantize(), fused.dequantize()[perm])
    c = from_gguf(gguf_bytes("Q5_0", 4, 64, seed=3), "Q5_0", (4, 64))
    wide = QuantizedTensor.cat([a, c, b])  # 4-bit parts beside a 5-bit one: held as 5-bit, values unchanged
    assert wide.kind == "q5" and wide.source == "Q4_0+Q4_1+Q5_0"
    torch.testing.assert_close(wide.dequantize(), torch.cat([a.dequantize(), c.dequantize(), b.dequantize()]))
    mixed = QuantizedTensor.cat([a, c, quantize_int8(torch.randn(2, 64))])  # 8-bit rows kept apart
    assert isinstance(mixed, QuantizedStack) and [p.kind for p in mixed.parts] == ["q5", "q8"]
    torch.testing.assert_close(mixed.dequantize()[:8], a.dequantize())
    with pytest.raises(ValueError, match="different in_features"):
        QuantizedTensor.cat([a, quantize_int8(torch.randn(2, 32))])


def test_int8_is_per_channel_symmetric():
    w = torch.randn(6, 100) * torch.arange(1, 7).unsqueeze(1)
    qt = quantize_int8(w)
    assert qt.kind == "q8" and qt.scale.shape == (6, 4)
    scales = qt.scale
    assert torch.equal(scales, scales[:, :1].expand(6, 4))  # one scale per row
    torch.testing.assert_close(scales[:, 0], w.abs().amax(1) / 127)
    assert (qt.dequantize() - w).abs().max() <= scales.max() / 2 + 1e-6


SYMMETRIC = ("Q8_0", "Q4_0", "Q5_0")  # offset = q's middle x scale: packed without offsets
VALUE_BYTES = {"q4": 16, "q5": 20, "q8": 32}  # bytes 32 values of q take packed


def test_packed_scales_are_halves_where_the_file_has_them():
    """The one-f16-per-block formats pack their scales and offsets as halves, and the symmetric ones no offsets
    at all (their packed weights are then the file's own size, 5-bit q too); Q4_K and Q5_K keep the file's
    f16 d and dmin with a byte per 6-bit sub-scale and minimum (0.578 bytes a value for Q4_K, the file's 0.5625);
    int8, whose scales an f16 cannot hold exactly, keeps float32 (without offsets); Q6_K packs as the file holds
    it."""
    n, k = 32, 256
    for qtype in GGUF_KERNEL_TYPES:
        raw = gguf_bytes(qtype, n, k, seed=5)
        qt = from_gguf(raw, qtype, (n, k))
        packed = qt.pack()
        if qtype == "Q6_K":  # 6-bit q, int8 sub-scales, f16 super-scales: the file's bytes, no offsets
            assert packed.offset is None and qt.offset_is_mid()
            assert packed.scale.dtype == torch.int8 and packed.super_scale.dtype == torch.float16
            assert packed.nbytes == qt.nbytes == raw.nbytes
            continue
        assert (packed.offset is None) == (qtype in SYMMETRIC) == qt.offset_is_mid(), qtype
        if qtype in KQUANTS:  # a byte per sub-scale and minimum, f16 d and dmin per 256 values
            assert packed.scale.dtype == packed.offset.dtype == torch.uint8, qtype
            assert packed.super_scale.dtype == torch.float16 and not qt.scales_fit_f16(), qtype
            per_block = VALUE_BYTES[qt.kind] + 2 + 4 * 32 / 256
            assert packed.nbytes == qt.nbytes == per_block * n * k // 32, qtype
            assert qt.pack(torch.float32).scale.dtype == torch.float32, qtype
            continue
        assert packed.scale.dtype == torch.float16, qtype
        if packed.offset is not None:
            assert packed.offset.dtype == torch.float16, qtype
        # the values, then the scale and the offset (when stored) as halves
        per_block = VALUE_BYTES[qt.kind] + 2 + (0 if qtype in SYMMETRIC else 2)
        assert packed.nbytes == qt.nbytes == per_block * n * k // 32, qtype
        if qtype in ("Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q5_1"):
            assert packed.nbytes == raw.nbytes, qtype
    int8 = quantize_int8(torch.randn(n, k)).pack()
    assert int8.scale.dtype == torch.float32 and int8.offset is None
    with pytest.raises(ValueError, match="float16 or float32"):
        from_gguf(gguf_bytes("Q4_K", n, k), "Q4_K", (n, k)).pack(torch.bfloat16)
    with pytest.raises(ValueError, match="int8 sub-scales"):
        qt.pack(torch.float32)  # the Q6_K one: one packing only
    with pytest.raises(ValueError, match="not -8.0 x its scales"):
        from_gguf(gguf_bytes("Q4_1", n, k), "Q4_1", (n, k)).pack(store_offsets=False)


def assert_packings_agree(kernels, qt: QuantizedTensor, packings, dtype, gen, what: str) -> None:
    """Two packings of ``qt`` give bit for bit the same GEMM outputs at every row count class (on the VNNI / AVX
    loops, and on the AMX tiles where this CPU has them) and the same dequantization, that of ``qt``."""
    n, k = qt.shape
    for amx in ([False, True] if kernels.amx_int8 else [False]):
        if kernels.amx_int8:
            kernels.set_amx_qdot(amx, min_rows=1)
        for rows in (1, 4, 5, 17):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            outs = []
            for packed in packings:
                out = torch.empty(rows, n, dtype=dtype)
                kernels.quant_linear(x, packed.descriptor(), None, out)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), f"{what}, {rows} rows, amx {amx}, {kernels.level}"
    if kernels.amx_int8:
        kernels.set_amx_qdot(True)
    deq = [torch.empty(n, k) for _ in packings]
    for packed, out in zip(packings, deq):
        kernels.quant_dequantize(packed.descriptor(), None, out)
    assert torch.equal(deq[0], deq[1]), what
    torch.testing.assert_close(deq[0], qt.dequantize(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_computed_offsets_give_the_stored_ones_outputs(kernels, dtype):
    """A symmetric weight packed without offsets (the kernels compute mid x scale) gives bit for bit what the
    same weight packed with them gives, with half and float32 scales."""
    gen = torch.Generator().manual_seed(11)
    weights = [(q, from_gguf(gguf_bytes(q, 40, 576, seed=3), q, (40, 576))) for q in SYMMETRIC]
    weights.append(("int8", quantize_int8(torch.randn(40, 576, generator=gen))))
    for qtype, qt in weights:
        for scale_dtype in ((torch.float16, torch.float32) if qtype != "int8" else (torch.float32,)):
            computed, stored = qt.pack(scale_dtype), qt.pack(scale_dtype, store_offsets=True)
            assert computed.offset is None and stored.offset is not None
            assert_packings_agree(kernels, qt, (computed, stored), dtype, gen, f"{qtype}, {scale_dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_half_and_float_scales_give_the_same_outputs(kernels, dtype):
    """Halves that are exact convert to the same float32 scales: either packing gives the same outputs."""
    gen = torch.Generator().manual_seed(7)
    for qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        qt = from_gguf(gguf_bytes(qtype, 40, 576, seed=9), qtype, (40, 576))
        assert_packings_agree(kernels, qt, (qt.pack(torch.float16), qt.pack(torch.float32)), dtype, gen, qtype)


def test_stored_offsets_beyond_a_half_keep_float32_scales(kernels):
    """Q8_0 scales of 1000 are halves, their offsets (-128 x) are not (past 65504): without stored offsets the
    scales pack as halves, with them both go float32; the outputs agree either way."""
    n, k = 16, 64
    rng = np.random.default_rng(2)
    blocks = np.zeros((n * k // 32, 34), np.uint8)
    blocks[:, 0:2] = np.full((len(blocks), 1), 1000, np.float16).view(np.uint8)
    blocks[:, 2:] = rng.integers(-127, 128, (len(blocks), 32), dtype=np.int8).view(np.uint8)
    qt = from_gguf(blocks.reshape(-1), "Q8_0", (n, k))
    computed, stored = qt.pack(), qt.pack(store_offsets=True)
    assert computed.offset is None and computed.scale.dtype == torch.float16
    assert stored.scale.dtype == stored.offset.dtype == torch.float32
    torch.testing.assert_close(qt.dequantize(), reference_dequant(blocks.reshape(-1), "Q8_0", n, k))
    assert_packings_agree(kernels, qt, (computed, stored), torch.float32, torch.Generator().manual_seed(3), "big")


def q6k_beside_q4k(n_q: int = 40, n_v: int = 24, k: int = 512) -> QuantizedStack:
    """A llama.cpp Q4_K_M layer's fused q/k/v: Q4_K q and k, a Q6_K v."""
    parts = [from_gguf(gguf_bytes(t, n, k, seed=i), t, (n, k))
             for i, (t, n) in enumerate([("Q4_K", n_q), ("Q4_K", 16), ("Q6_K", n_v)])]
    fused = QuantizedTensor.cat(parts)
    assert isinstance(fused, QuantizedStack) and [p.kind for p in fused.parts] == ["q4", "q6"]
    assert fused.shape == (n_q + 16 + n_v, k) and fused.source == "Q4_K+Q6_K"
    return fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stack_of_parts_in_different_layouts_is_one_linear(kernels, dtype):
    """Q4_K rows and Q6_K rows kept apart (not pulled to float32 together) and chained in one descriptor: one call
    writes every part's columns, bias included, as the parts alone would; dequantization follows the parts."""
    fused = q6k_beside_q4k()
    n, k = fused.shape
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(n, generator=gen).to(dtype)
    layer = QuantLinear(fused, bias, kernels, dtype)
    assert (layer.out_features, layer.in_features) == (n, k) and layer.quant.nbytes == fused.nbytes
    for rows in (1, 3, 9):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        out = layer(x)
        want = emulate(x.float(), fused) + bias.double()
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), want, atol=tol * want.abs().max().item(), rtol=tol, msg=kernels.level)
    full = layer.dequantized(torch.float32)
    torch.testing.assert_close(full, fused.dequantize(), atol=1e-6, rtol=0)
    picked = torch.empty(3, k)
    kernels.quant_dequantize(layer.desc, torch.tensor([n - 1, 0, 41]), picked)
    torch.testing.assert_close(picked, full[[n - 1, 0, 41]], atol=0, rtol=0)


def test_q6k_matches_the_gguf_packages_matmul(kernels):
    """Q6_K on its integer kernel against the gguf package's dequantization and a float64 matmul: within the
    activations' 15-bit quantization error, at every instruction-set level."""
    n, k = 48, 768
    raw = gguf_bytes("Q6_K", n, k, seed=3)
    layer = QuantLinear(from_gguf(raw, "Q6_K", (n, k)), None, kernels, torch.float32)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    exact = x.double() @ reference_dequant(raw, "Q6_K", n, k).double().t()
    err = (layer(x).double() - exact).norm() / exact.norm()
    assert err < 1e-4, f"relative error {err:.2e} at {kernels.level}"


def test_q6k_scales_that_are_not_int8_multiples_are_refused():
    qt = from_gguf(gguf_bytes("Q6_K", 16, 256), "Q6_K", (16, 256))
    qt.scale[0, 0] *= 1.5
    with pytest.raises(ValueError, match="not an f16 super-scale times int8"):
        qt.pack()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_quant_sub_scales_give_the_float32_scales_outputs(kernels, dtype):
    """Q4_K / Q5_K packed with byte sub-scales and f16 super-scales (the file's form) compute bit for bit what their
    float32 scales and offsets compute: d * sc and -dmin * m are exact in float32."""
    gen = torch.Generator().manual_seed(13)
    for qtype in ("Q4_K", "Q5_K"):
        qt = from_gguf(gguf_bytes(qtype, 40, 768, seed=4), qtype, (40, 768))
        kquant, floats = qt.pack(), qt.pack(torch.float32)
        assert kquant.scale.dtype == torch.uint8 and floats.scale.dtype == torch.float32
        assert kquant.nbytes < (0.8 if qtype == "Q4_K" else 0.85) * floats.nbytes
        assert_packings_agree(kernels, qt, (kquant, floats), dtype, gen, qtype)
