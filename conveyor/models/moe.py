"""The routed MLP of a mixture of experts (``ModelConfig.moe``): a router, ``num_experts`` gated MLPs, and each
step's tokens grouped by the experts they chose, so that every chosen expert runs once on its rows.

Per step of T tokens (transformers' ``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock`` / ``OlmoeSparseMoeBlock``
compute the same):

    logits = h @ W_router^T                        [T, E]   (the router: ``RouterLinear``, never quantized)
    p = softmax(logits) (float32); the top_k largest p of each token pick its experts; with norm_topk_prob they are
        divided by their sum
    out[t] = sum over token t's experts e, in increasing e, of p_e * expert_e(h[t])

Grouping: the T * top_k choices are sorted by expert, so expert e sees one [n_e, hidden] block of rows and its
gate_up and down GEMMs run once per step on them (and an expert no token chose is not read at all: a decode step of
B tokens reads at most B * top_k experts, docs/moe.md measures how many).

Each expert is an ordinary gated MLP (``gate_up_proj``, ``down_proj``), so the machinery of dense linears applies
to it unchanged: CPU packing (``layers.linear``), GGUF blocks kept quantized and ``--quantization int8``
(``models.quantize``). On the CPU with the native kernels, ``NativeExperts`` runs the routing and every chosen
expert of a step in one native call (``kernels/csrc/moe.cpp``) where the rows fit the experts' native GEMMs; the
torch loop below is the path elsewhere (float64, a GPU, prefill chunks above the skinny GEMM's rows).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from conveyor.models.config import ModelConfig


class RouterLinear(nn.Linear):
    """A mixture's router: hidden -> one logit per expert. It stays in the float dtype whatever the experts are
    stored in (``models.quantize`` skips it, as vLLM and llama-quantize keep ``ffn_gate_inp`` unquantized): its
    logits choose the experts, and a rounding that flips a choice changes the output by a whole expert."""


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int64) from router logits [T, E], as transformers'
    routers compute them: softmax in float32 over every expert, the top_k largest, optionally renormalised."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """sum_k weights[t, k] * experts[ids[t, k]](x[t]) for every token t: the choices grouped by expert, each
    chosen expert run once on its rows, their outputs added into the result in increasing expert order."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # choices grouped by expert; tokens ascending within a group
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # the step's one host sync
    tokens = order // top_k
    scale = weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)  # transformers' routers hand x's dtype on
    out = torch.zeros_like(x)
    start = 0
    for expert, n in zip(experts, counts):
        if n:
            rows = tokens[start:start + n]
            out.index_add_(0, rows, expert(x.index_select(0, rows)) * scale[start:start + n])
            start += n
    return out


class SparseMoE(nn.Module):
    """The routed MLP (module doc): ``gate`` the router, ``experts`` the gated MLPs ``make_expert`` builds."""

    def __init__(self, cfg: ModelConfig, make_expert: Callable[[], nn.Module]) -> None:
        super().__init__()
        moe = cfg.moe
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = RouterLinear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(moe.num_experts))
        self.native = None  # NativeExperts (models.native_moe), set by models.cpu_layout.prepare_for_cpu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.native is not None and self.native.accepts(x):
            return self.native.run(x, logits)
        weights, ids = route(logits, self.top_k, self.norm_topk_prob)
        return run_experts(x, weights, ids, self.experts)
