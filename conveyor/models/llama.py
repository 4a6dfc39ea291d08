"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM), gpt-fast style.

Names follow the reference implementation (q_proj, k_proj, ..., gate_proj, up_proj), but the projections that
read the same input are fused at load time: one ``qkv_proj`` and one ``gate_up_proj`` matmul per layer.
Qwen2 differs only by a bias on q/k/v. Mistral's sliding window is not applied (exact up to the window).
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.layers.activation import silu_and_mul
from conveyor.layers.embedding import Embedding
from conveyor.layers.norms import RMSNorm
from conveyor.layers.rotary import RotaryEmbedding, apply_rotary
from conveyor.models.config import ModelConfig
from conveyor.models.weights import WeightTarget


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, kv_cache, attn):
        qkv = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)  # [T, H + 2 * KVH, d]
        rotated = self.num_heads + self.num_kv_heads
        qk = apply_rotary(qkv[:, :rotated], cos, sin)  # q and k heads rotated in one go
        q, k, v = qk[:, :self.num_heads], qk[:, self.num_heads:], qkv[:, rotated:]
        out = attn.forward(q, k, v, kv_cache, self.scale)
        return self.o_proj(out.view(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin, kv_cache, attn):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    """forward(input_ids[T], positions[T], kv_caches, attn) -> hidden [T, hidden]; compute_logits(hidden)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids, positions, kv_caches, attn):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions)  # once per step, shared by all layers
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, attn)
        return self.norm(x)

    def get_input_embeddings(self) -> Embedding:
        return self.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)

    def map_weight(self, name: str) -> WeightTarget | None:
        """Where HF checkpoint weight ``name`` goes (None: skip it). q/k/v and gate/up fill rows of fused ones."""
        cfg = self.config
        name = name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None  # recomputed buffers; tied lm_head copies some checkpoints store anyway
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        for short, fused, offset, rows in (("q_proj", "qkv_proj", 0, q), ("k_proj", "qkv_proj", q, kv),
                                           ("v_proj", "qkv_proj", q + kv, kv), ("gate_proj", "gate_up_proj", 0, inter),
                                           ("up_proj", "gate_up_proj", inter, inter)):
            if f".{short}." in name:
                return WeightTarget(name.replace(short, fused), offset, rows)
        return WeightTarget(name)
