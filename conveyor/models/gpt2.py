"""GPT-2: learned positions, pre-LayerNorm blocks, gelu_new MLP, fused c_attn, tied lm_head.

HF stores GPT-2's projections as Conv1D ([in, out]); we transpose them at load time into nn.Linear ([out, in]).
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.layers.activation import gelu_new
from conveyor.layers.embedding import Embedding
from conveyor.models.config import ModelConfig
from conveyor.models.family import ModelFamily
from conveyor.models.hf_config import HFConfig
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
        self.native_stack = None  # GPT-2's blocks are not the native layer stack's (native_stack.unsupported_reason)

    def forward(self, input_ids, positions, kv_caches, attn):
        x = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            x = block(x, kv_cache, attn)
        return self.ln_f(x)

    def get_input_embeddings(self) -> Embedding:
        return self.wte

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:  # on CPU always: prepare_for_cpu gives a tied model its own packed head
            return self.lm_head(hidden)
        return torch.nn.functional.linear(hidden, self.wte.weight)

    def map_weight(self, name: str) -> WeightTarget | None:
        """Where HF checkpoint weight ``name`` goes (None: skip it); Conv1D weights are transposed."""
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")) or (name == "lm_head.weight" and self.lm_head is None):
            return None  # old checkpoints' causal-mask buffers; tied lm_head copy
        return WeightTarget(name, transpose=name.endswith(CONV1D_WEIGHTS))


def from_hf(c: HFConfig, architecture: str) -> ModelConfig:
    hidden, heads = c.require("n_embd"), c.require("n_head")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        c.expect(key, False, why="GPT-2's attention variants are not computed")
    c.expect("activation_function", "gelu_new", "gelu_pytorch_tanh", why="the MLP runs tanh-GELU")
    c.expect("scale_attn_weights", True, why="attention is scaled by head_dim ** -0.5")
    for key in ("n_ctx", "layer_norm_epsilon", "n_inner", "summary_type", "summary_use_proj", "summary_activation",
                "summary_proj_to_labels", "summary_first_dropout", "attn_pdrop"):
        c.get(key)  # read below, or settings of other heads than the language model's
    eos = c.get("eos_token_id")
    return ModelConfig(architecture=architecture, family="gpt2", hidden_size=hidden, num_layers=c.require("n_layer"),
                       num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                       intermediate_size=c.get("n_inner") or 4 * hidden, vocab_size=c.require("vocab_size"),
                       max_position_embeddings=c.require("n_positions"), norm_eps=c.get("layer_norm_epsilon", 1e-5),
                       tie_word_embeddings=c.get("tie_word_embeddings", True), activation="gelu_tanh", gated_mlp=False,
                       bos_token_id=c.get("bos_token_id"),
                       eos_token_ids=[] if eos is None else [int(t) for t in (eos if isinstance(eos, list) else [eos])])


FAMILY = ModelFamily(name="gpt2", hf_architectures=("GPT2LMHeadModel",), config_from_hf=from_hf, build=GPT2LMHeadModel)
