"""GPT-2: learned positions, pre-LayerNorm blocks, gelu_new MLP, fused c_attn, tied lm_head.

HF stores GPT-2's projections as Conv1D ([in, out]); we transpose them at load time into nn.Linear ([out, in]).
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.layers.activation import gelu_new
from conveyor.layers.embedding import Embedding
from conveyor.models.config import ModelConfig
from conveyor.models.weights import WeightTarget

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # fused q, k, v
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, kv_cache, attn):
        q, k, v = self.c_attn(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        out = attn.forward(q, k, v, kv_cache, self.scale)
        return self.c_proj(out.reshape(x.shape[0], -1))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return self.c_proj(gelu_new(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x, kv_cache, attn):
        h = x + self.attn(self.ln_1(x), kv_cache, attn)
        return h + self.mlp(self.ln_2(h))


class GPT2LMHeadModel(nn.Module):
    """forward(input_ids[T], positions[T], kv_caches, attn) -> hidden [T, hidden]; compute_logits(hidden)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, positions, kv_caches, attn):
        x = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            x = block(x, kv_cache, attn)
        return self.ln_f(x)

    def get_input_embeddings(self) -> Embedding:
        return self.wte

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)

    def map_weight(self, name: str) -> WeightTarget | None:
        """Where HF checkpoint weight ``name`` goes (None: skip it); Conv1D weights are transposed."""
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")) or (name == "lm_head.weight" and self.lm_head is None):
            return None  # old checkpoints' causal-mask buffers; tied lm_head copy
        return WeightTarget(name, transpose=name.endswith(CONV1D_WEIGHTS))
