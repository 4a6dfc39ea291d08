"""Many LoRA adapters in one step: the base linear once for every row, then each row's adapter's low-rank product.

A ``LoRALinear`` wraps a model's linear layer (a ``PackedLinear``, a ``QuantLinear``, a plain ``nn.Linear``): its
base GEMM runs over the whole step as before, then ``y[rows of slot s] += x[rows] @ A[s] @ B[s]`` for each adapter
slot with rows in the step. The slots' weights are tensors ``a`` [slots, K, SR] and ``b`` [slots, SR, N] in float32
or bfloat16 (``weight_dtype``; the products are summed in float32 either way; the scaling folded into b): a fused
projection (qkv, gate_up) holds one rank slice per part, ``SR = parts x R``, and part p's columns of y read slice p
only (the native kernel skips the other slices; the torch path multiplies their zeros). An adapter of rank r < R
fills the first r rows of its slice; the rest stay zero.

Which rows belong to which slot is the step's ``LoRAStep``, shared by every ``LoRALinear`` of the model and set by
the runner before the forward pass (rows grouped by slot, S-LoRA / Punica's segments). The native kernel
(``CpuKernels.lora``, csrc/lora.cpp) runs the segments in one call on CPU in float32 and bfloat16; elsewhere (CUDA,
float16, no kernels) a torch loop over the slots does (``segmented=False`` forces it: the benchmark's per-adapter
loop).
"""

from __future__ import annotations

import torch
from torch import nn


class LoRAStep:
    """The step's rows of each adapter slot, shared by a model's ``LoRALinear`` layers."""

    def __init__(self, kernels=None, segmented: bool = True) -> None:
        self.kernels = kernels if segmented else None
        self.active = False
        self.rows = torch.empty(0, dtype=torch.int64)  # rows with an adapter, grouped by slot
        self.seg_start = torch.zeros(1, dtype=torch.int64)  # [S + 1] offsets into rows
        self.seg_slot = torch.empty(0, dtype=torch.int64)  # [S] the slot of each segment
        self.groups: list[tuple[int, torch.Tensor]] = []  # (slot, its rows) for the torch path

    def set(self, spans: list[tuple[int, int, int]], device: torch.device | str = "cpu") -> None:
        """This step's rows: ``spans`` of (first row, end row, slot) for the requests that run an adapter."""
        by_slot: dict[int, list[int]] = {}
        for start, end, slot in spans:
            by_slot.setdefault(slot, []).extend(range(start, end))
        self.active = bool(by_slot)
        if not self.active:
            self.groups = []
            return
        slots = sorted(by_slot)
        rows = [r for s in slots for r in by_slot[s]]
        starts = [0]
        for s in slots:
            starts.append(starts[-1] + len(by_slot[s]))
        self.rows = torch.tensor(rows, dtype=torch.int64)
        self.seg_start = torch.tensor(starts, dtype=torch.int64)
        self.seg_slot = torch.tensor(slots, dtype=torch.int64)
        self.groups = [(s, torch.tensor(by_slot[s], dtype=torch.int64, device=device)) for s in slots]

    def clear(self) -> None:
        self.active = False
        self.groups = []


class LoRALinear(nn.Module):
    """``base(x)`` plus, for the step's rows with an adapter, that adapter's low-rank product (module doc).
    ``parts``: the output column ranges [(start, end), ...] of a fused projection's parts, in order."""

    def __init__(self, base: nn.Module, step: LoRAStep, parts: list[tuple[int, int]], in_features: int,
                 num_slots: int, rank: int, device: torch.device | str = "cpu",
                 weight_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.base, self.step, self.rank = base, step, rank
        self.parts = parts
        out_features = parts[-1][1]
        self.in_features, self.out_features = in_features, out_features
        sr = rank * len(parts)
        self.a = torch.zeros(num_slots, in_features, sr, dtype=weight_dtype, device=device)
        self.b = torch.zeros(num_slots, sr, out_features, dtype=weight_dtype, device=device)
        self.sub_cols = torch.tensor([p[0] for p in parts] + [out_features], dtype=torch.int64)

    def load_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put an adapter's (A [in, r], B [r, out part]) per part (None: the adapter leaves that part alone)
        into ``slot``."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for p, (w, (c0, c1)) in enumerate(zip(weights, self.parts)):
            if w is None:
                continue
            a, b = w
            r = a.shape[1]
            self.a[slot, :, p * self.rank:p * self.rank + r] = a
            self.b[slot, p * self.rank:p * self.rank + r, c0:c1] = b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.step
        if not step.active:
            return y
        kernels = step.kernels
        if kernels is not None and x.device.type == "cpu" and x.dtype in kernels.lora.dtypes and x.dtype == y.dtype:
            if x.stride(-1) != 1:
                x = x.contiguous()
            if y.stride(-1) != 1:
                y = y.contiguous()
            kernels.lora.apply(x, y, self.a, self.b, step.rows, step.seg_start, step.seg_slot, self.sub_cols,
                               self.rank)
            return y
        for slot, rows in step.groups:  # the torch path: one adapter at a time
            xa = x.index_select(0, rows).float() @ self.a[slot].float()
            y.index_add_(0, rows, (xa @ self.b[slot].float()).to(y.dtype))
        return y

    def extra_repr(self) -> str:
        return f"rank={self.rank}, parts={len(self.parts)}, slots={self.a.shape[0]}, dtype={self.a.dtype}"
