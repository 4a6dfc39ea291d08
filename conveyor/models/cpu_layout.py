"""Lay linear weights out for fast skinny matmuls on CPU.

``F.linear(x, W)`` computes ``x @ W.T``. With W stored row-major ([out, in], as checkpoints hold it) the BLAS
call gets a transposed B, and on this class of CPU its small-M kernels (decode: M = batch size) run 1.3-1.9x
slower than with B already [in, out] contiguous (measured: M=25, [2816 x 512]: 0.92 ms vs 0.52 ms; lm_head
[32000 x 512]: 12.2 ms vs 7.6 ms). So after loading we keep each weight's logical shape but store it
column-major (``W.t().contiguous().t()``): every ``nn.Linear`` and state-dict name stays as it was.
"""

from __future__ import annotations

import torch
from torch import nn


def _column_major(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous().t()


@torch.no_grad()
def relayout_for_cpu(model: nn.Module) -> None:
    """Store every linear weight column-major; give a tied-embedding model its own column-major lm_head.

    A tied model's embedding keeps its row-major copy (the token lookup reads rows); the logits matmul gets a
    column-major copy, which costs ``vocab x hidden`` more memory (65 MB for the bench model).
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.data = _column_major(module.weight.data)
    if model.lm_head is None:  # tied: the logits matmul reads the embedding
        embedding = model.get_input_embeddings()
        # built on the meta device: a real one would spend 0.25 s (SmolLM2's 49152 x 576) on a random init
        head = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False, device="meta")
        head.weight = nn.Parameter(_column_major(embedding.weight.data), requires_grad=False)
        model.lm_head = head.requires_grad_(False)
