"""The FLOPs of a forward pass, counted from the model itself (one definition for every benchmark)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # counting needs no torch import: `conveyor bench --help` stays light
    from torch import nn

_NOT_PER_TOKEN = ("embed", "lm_head", "wte", "wpe")  # lookups, and the lm_head that only sampled rows pay


def per_token_linear_params(model: nn.Module) -> int:
    """Weights every computed token multiplies through: all 2-D parameters but embeddings and the lm_head."""
    return sum(p.numel() for name, p in model.named_parameters()
               if p.dim() == 2 and not any(k in name for k in _NOT_PER_TOKEN))


def forward_flops(model: nn.Module, info, num_tokens: int, num_sampled: int, attended_keys: float) -> float:
    """Matmul FLOPs of computing ``num_tokens`` tokens, ``num_sampled`` of them through the lm_head, where the
    queries attend to ``attended_keys`` keys in all (the sum over queries of their context length)."""
    linear = 2.0 * per_token_linear_params(model) * num_tokens
    lm_head = 2.0 * info.hidden_size * info.vocab_size * num_sampled
    attention = 4.0 * info.num_layers * info.num_heads * info.head_dim * attended_keys
    return linear + lm_head + attention
