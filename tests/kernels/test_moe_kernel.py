"""The native routed MLP (csrc/moe.cpp, ``CpuKernels.moe``) against the torch loop of ``models.moe`` over the same
expert modules: quantized experts (float32 and bfloat16 activations), float32 experts on the skinny GEMM, experts
of mixed kinds, renormalised or not, steps of one token to many; and its argument checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conveyor.kernels import load_cpu_kernels
from conveyor.kernels.cpu_ops import KernelError
from conveyor.kernels.moe_ops import MOE_FLOAT
from conveyor.layers.linear import pack_linear
from conveyor.layers.quantized import QuantLinear, quantize_int8
from conveyor.models.moe import route, run_experts
from conveyor.models.native_moe import NativeExperts

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no native kernels on this CPU")
HIDDEN, WIDTH, EXPERTS = 96, 64, 6


class Expert(nn.Module):
    """A gated MLP of native linears (what ``prepare_for_cpu`` leaves in an expert)."""

    def __init__(self, gate_up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up, down

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)


def linear(n: int, k: int, kind: str, dtype: torch.dtype, seed: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    if kind == "int8":
        return QuantLinear(quantize_int8(w), None, KERNELS, dtype)
    return pack_linear(w.to(dtype), None, KERNELS)


class Moe(nn.Module):  # the parts of models.moe.SparseMoE that NativeExperts.build reads
    def __init__(self, kinds: list[tuple[str, str]], dtype: torch.dtype, top_k: int, norm: bool) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False).to(dtype)
        self.experts = nn.ModuleList(Expert(linear(2 * WIDTH, HIDDEN, gu, dtype, 2 * e), linear(HIDDEN, WIDTH, d, dtype,
                                                                                               2 * e + 1))
                                     for e, (gu, d) in enumerate(kinds))


@pytest.mark.parametrize("dtype,kinds", [
    (torch.float32, [("int8", "int8")] * EXPERTS),
    (torch.bfloat16, [("int8", "int8")] * EXPERTS),
    (torch.float32, [("float", "float")] * EXPERTS),
    (torch.float32, [("int8", "float"), ("float", "int8")] * (EXPERTS // 2)),  # a Q4_K_M file's Q6_K downs
])
@pytest.mark.parametrize("top_k,norm", [(2, True), (3, False)])
@pytest.mark.parametrize("rows", [1, 40])
def test_native_routed_mlp_matches_the_torch_loop(dtype, kinds, top_k, norm, rows):
    moe = Moe(kinds, dtype, top_k, norm)
    native = NativeExperts.build(moe, KERNELS)
    assert native is not None and native.accepts(torch.zeros(rows, HIDDEN, dtype=dtype))
    assert (native.table[:, 1] == MOE_FLOAT).tolist() == [gu == "float" for gu, _ in kinds]
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(dtype)
    logits = torch.randn(rows, EXPERTS, generator=torch.Generator().manual_seed(7)) * 2
    got = native.run(x, logits)
    weights, ids = route(logits, top_k, norm)
    want = run_experts(x, weights, ids, moe.experts)
    # the same experts on the same rows; the softmax's exp may differ in the last bits
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_an_expert_no_token_chose_is_not_read():
    """Its weight pointers may point anywhere: a step whose tokens all chose other experts never touches them."""
    moe = Moe([("int8", "int8")] * EXPERTS, torch.float32, 2, True)
    native = NativeExperts.build(moe, KERNELS)
    logits = torch.full((3, EXPERTS), -30.0)
    logits[:, 0], logits[:, 1] = 5.0, 4.0  # every token: experts 0 and 1
    native.table[2:, 0] = 1  # address 1: reading it would crash
    native.table[2:, 2] = 1
    x = torch.randn(3, HIDDEN)
    got = native.run(x, logits)
    weights, ids = route(logits, 2, True)
    torch.testing.assert_close(got, run_experts(x, weights, ids, moe.experts), atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_refused():
    moe = Moe([("float", "float")] * EXPERTS, torch.float32, 2, True)
    native = NativeExperts.build(moe, KERNELS)
    x, logits, out = torch.randn(2, HIDDEN), torch.randn(2, EXPERTS), torch.empty(2, HIDDEN)
    with pytest.raises(KernelError, match="cvk_moe"):  # more experts a token than experts
        KERNELS.moe.run(x, logits, native.table, out, WIDTH, EXPERTS + 1, True)
    table = native.table.clone()
    table[0, 1] = 7  # an unknown kind
    with pytest.raises(KernelError, match="bad argument"):
        KERNELS.moe.run(x, logits, table, out, WIDTH, 2, True)
    with pytest.raises(KernelError, match="bad argument"):  # float experts take float32 activations only
        KERNELS.moe.run(x.bfloat16(), logits, native.table, out.bfloat16(), WIDTH, 2, True)
