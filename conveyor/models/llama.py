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

    def forward(self, x, rope, kv_cache, attn):
        qkv = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)  # [T, H + 2 * KVH, d]
        rotated = self.num_heads + self.num_kv_heads
        q, k, v = qkv[:, :self.num_heads], qkv[:, self.num_heads:rotated], qkv[:, rotated:]
        if attn.fuses_rope:  # the backend rotates q and k in place as it stores k
            out = attn.forward(q, k, v, kv_cache, self.scale, rope=rope.table)
        else:
            cos, sin = rope.cos, rope.sin
            qk = apply_rotary(qkv[:, :rotated], cos, sin)  # q and k heads rotated in one go
            out = attn.forward(qk[:, :self.num_heads], qk[:, self.num_heads:], v, kv_cache, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.kernels = None  # native CPU kernels for the activation (models.cpu_layout.prepare_for_cpu)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.kernels))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, residual, rope, kv_cache, attn):
        """x: the previous layer's output, still to be added to the residual stream (None at layer 0, where x is
        the embeddings). Returns (this layer's output, residual): the adds are fused into the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


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
        # every layer in one native call for decode-sized steps (models.native_stack; set by prepare_for_cpu)
        self.native_stack = None

    def forward(self, input_ids, positions, kv_caches, attn):
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, fused=attn.fuses_rope)  # once per step
        if self.native_stack is not None and self.native_stack.accepts(x.shape[0], attn):
            x, residual = self.native_stack.run(x, rope.table, kv_caches, attn)
            return self.norm(x, residual)[0]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, attn)
        return self.norm(x, residual)[0]

    def get_input_embeddings(self) -> Embedding:
        return self.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:  # on CPU always: prepare_for_cpu gives a tied model its own packed head
            return self.lm_head(hidden)
        return torch.nn.functional.linear(hidden, self.embed_tokens.weight)

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
