"""The segmented LoRA kernel (csrc/lora.cpp) against torch, at every ISA level this CPU runs: rows of several
adapters (and rows of none) in one call, a fused projection's parts each reading its own rank slice, float32 and
bfloat16 activations and adapter weights; and ``LoRALinear``'s torch path (the per-adapter loop) against the kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conveyor.layers.lora import LoRALinear, LoRAStep


def _case(dtype, rows=37, k=96, parts=(64, 48, 48), rank=8, slots=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(parts)
    x = torch.randn(rows, k, generator=g).to(dtype)
    slot_of = torch.randint(-1, slots, (rows,), generator=g).tolist()  # -1: the base model
    spans = [(i, i + 1, s) for i, s in enumerate(slot_of) if s >= 0]
    weights = []
    for s in range(slots):
        per_part = []
        for p, width in enumerate(parts):
            r = 1 + (s + p) % rank  # ranks below the slot's rank leave zeros
            per_part.append(None if (s + p) % 5 == 4 else
                            (torch.randn(k, r, generator=g), torch.randn(r, width, generator=g)))
        weights.append(per_part)
    return x, slot_of, spans, weights, n


def _reference(x, y0, slot_of, weights, parts, weight_dtype=torch.float32):
    """In float32, on the weights as the slots hold them (bfloat16 slots round each weight once)."""
    weights = [[None if w is None else tuple(t.to(weight_dtype).float() for t in w) for w in per_part]
               for per_part in weights]
    out = y0.float().clone()
    for i, s in enumerate(slot_of):
        if s < 0:
            continue
        c0 = 0
        for w, width in zip(weights[s], parts):
            if w is not None:
                out[i, c0:c0 + width] += (x[i].float() @ w[0]) @ w[1]
            c0 += width
    return out


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("segmented", [True, False])
def test_segments_of_many_adapters_equal_torch(kernels, dtype, segmented, weight_dtype):
    parts = (64, 48, 48)
    # 100 rows over 4 slots and the base: segments of several of the kernel's row blocks (8) and shrink blocks (16)
    x, slot_of, spans, weights, n = _case(dtype, rows=100, parts=parts)
    base = nn.Linear(x.shape[1], n, bias=False)
    nn.init.zeros_(base.weight)
    step = LoRAStep(kernels, segmented=segmented)
    cols, c = [], 0
    for width in parts:
        cols.append((c, c + width))
        c += width
    lin = LoRALinear(base.to(dtype), step, cols, x.shape[1], num_slots=len(weights), rank=8,
                     weight_dtype=weight_dtype)
    for s, w in enumerate(weights):
        lin.load_slot(s, w)
    step.set(spans)
    with torch.no_grad():
        y = lin(x)
    ref = _reference(x, torch.zeros(x.shape[0], n), slot_of, weights, parts, weight_dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # bfloat16: the one rounding of y's sum
    assert torch.allclose(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    step.clear()
    with torch.no_grad():
        assert torch.equal(lin(x), base(x))  # a step without adapter rows is the base linear alone
