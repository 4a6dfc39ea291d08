"""The FLOPs of a forward pass: one count for every benchmark and the simulator, ``sim.model_specs.ModelSpec``'s,
over the loaded model's spec (``ModelInfo.spec``, derived from the same config its layers were built from)."""

from __future__ import annotations


def forward_flops(info, num_tokens: int, num_sampled: int, attended_keys: float) -> float:
    """Matmul FLOPs of computing ``num_tokens`` tokens, ``num_sampled`` of them through the lm_head, where the
    queries attend to ``attended_keys`` keys in all (the sum over queries of their context length)."""
    return info.spec.forward_flops(num_tokens, num_sampled, attended_keys)


def token_flops(info) -> float:
    """FLOPs of one token through every layer's linear weights (the lm_head aside)."""
    return 2.0 * info.spec.per_token_linear_params


def prefix_hit_flops(info) -> tuple[float, float]:
    """(FLOPs per token through the layers, FLOPs per attended key): what a prefix-cache hit saves, priced as
    ``forward_flops(H, 0, H(H+1)/2)`` for H hit tokens."""
    return token_flops(info), 4.0 * info.spec.num_layers * info.spec.q_dim
