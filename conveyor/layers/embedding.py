"""Token and position embedding tables."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Embedding(torch.nn.Module):
    """A lookup table of ``num_embeddings`` rows of ``embedding_dim``. Its weight starts uninitialised: a checkpoint
    (or the embedded model's seeded init) fills it, so unlike ``nn.Embedding`` it draws no random numbers."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = torch.nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
