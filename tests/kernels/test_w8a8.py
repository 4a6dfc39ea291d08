"""W8A8 (layers/w8a8.py, csrc/gemm_w8a8.cpp): per-token int8 activations against per-channel int8 weights, at every
instruction-set level this CPU runs. The activations' integers and scales equal a torch reference of the same
arithmetic exactly; the native loop and oneDNN's s8s8s32 GEMM + the native epilogue give the same floats bit for
bit (the same integers through the same epilogue); both are the reference's float epilogue to float32 rounding."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.cpu_ops import KernelError
from conveyor.layers.quantized import int8_per_channel
from conveyor.layers.w8a8 import W8A8Linear, pack_w8a8


def reference(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None):
    """The same arithmetic in torch: per-row scale max |x| / 127, q = round-half-even(x * (127 / max |x|)) (a true
    float32 division, as the kernel divides: torch's scalar / tensor is a reciprocal times the scalar), exact int32
    sums, then float(sum) * (w_scale * x_scale) + bias in float64."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv).to(torch.int8)
    x_scale = (amax / 127.0).squeeze(-1)
    acc = xq.to(torch.int64) @ q.to(torch.int64).t()
    y = acc.double() * (w_scale.double()[None, :] * x_scale.double()[:, None])
    return xq, x_scale, acc, y if bias is None else y + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_is_the_references(kernels, dtype):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 200, generator=gen) * torch.logspace(-3, 2, 37)[:, None]).to(dtype)
    x[5] = 0  # a row of zeros: scale 0, q 0
    q, scale = kernels.w8a8.quantize(x)
    want_q, want_scale, _, _ = reference(x, torch.zeros(1, 200, dtype=torch.int8), torch.zeros(1), None)
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)
    assert q.abs().max() == 127 and scale[5] == 0 and not q[5].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(40, 72), (21, 576), (96, 1536)])
def test_native_loop_and_onednn_give_the_references_numbers(kernels, dtype, n, k):
    """Every row count takes both paths (the layer's switch forced): bit-identical to each other, the reference's
    floats to float32 rounding (bfloat16: to its rounding of the output)."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen).to(dtype)
    layer = W8A8Linear.from_float(w, bias, kernels, dtype)
    q, s = int8_per_channel(w)
    for rows in (1, 2, 7, 8, 9, 16, 33, 100):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        _, _, _, want = reference(x, q, s.view(-1), bias)
        layer.max_rows = 0
        onednn = layer(x)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(onednn.double(), want, **tol, msg=f"{rows} rows, {kernels.level}")
        if kernels.w8a8.native:
            layer.max_rows = 1 << 30
            assert torch.equal(layer(x), onednn), f"{rows} rows at {kernels.level}: the two paths differ"
        else:
            out = torch.empty(rows, n, dtype=dtype)
            with pytest.raises(KernelError):
                kernels.quant_linear(x, layer.desc, layer.bias, out)


def test_the_native_loop_is_there_at_the_avx512_levels_only(kernels):
    """AVX2 has no W8A8 loop: every row count takes oneDNN there (its own ISA choice), so a W8A8 model on an
    AVX2-only CPU runs rather than dying of SIGILL; W8A8Linear then never calls the loop."""
    assert kernels.w8a8.native == (kernels.level != "avx2")
    layer = W8A8Linear.from_float(torch.randn(16, 64), None, kernels, torch.float32)
    assert (layer.max_rows > 0) == kernels.w8a8.native
    torch.testing.assert_close(layer(torch.ones(40, 64)), torch.ones(40, 64) @ layer.dequantized(torch.float32).t(),
                               rtol=1e-5, atol=1e-4)


def test_packed_w8a8_dequantizes_to_its_integers_times_scales(kernels):
    gen = torch.Generator().manual_seed(5)
    q, s = int8_per_channel(torch.randn(35, 100, generator=gen))
    packed = pack_w8a8(q, s)
    assert packed.kind == "w8a8" and packed.padded_in == 128 and packed.scale.shape == (48,)
    out = torch.empty(35, 100)
    kernels.quant_dequantize(packed.descriptor(), None, out)
    assert torch.equal(out, q.float() * s)
