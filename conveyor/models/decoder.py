"""The pre-norm decoder the Llama-style families share (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3), built
from a ``ModelConfig``'s declared features; a family's module decides which it has, never this file.

Per layer: fused ``qkv_proj`` (Phi-3 stores it fused; the others' q/k/v fill its rows at load), optional q/k
RMSNorm per head (Qwen3, Gemma 3), RoPE (partial rotary by a row order of q/k, see ``layers.rotary``), attention
with the layer's sliding window, ``o_proj``; a gated MLP (``gate_up_proj``, SiLU or tanh-GELU), or a mixture of
such MLPs behind a router (``models.moe``); two RMSNorms, or four (Gemma's "sandwich": after attention and after the
MLP too). Residual adds are fused into the next norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.layers.activation import silu_and_mul
from conveyor.layers.embedding import Embedding
from conveyor.layers.norms import RMSNorm
from conveyor.layers.rotary import RotaryEmbedding, apply_rotary, partial_rotary_order
from conveyor.models.config import ModelConfig
from conveyor.models.step_cut import CutFlag
from conveyor.models.moe import SparseMoE
from conveyor.models.weights import WeightTarget

_FUSED_PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # per head (Qwen3, Gemma 3), or across all heads (OLMoE: one norm over the whole q and the whole k)
        self.qk_norm_across_heads = cfg.qk_norm_across_heads
        q_norm, k_norm = (self.q_size, self.kv_size) if cfg.qk_norm_across_heads else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(q_norm, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_norm, cfg.norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attn_scale or self.head_dim ** -0.5
        self.window = cfg.window(layer)  # 0: full attention
        self.rope_index = 1 if cfg.local_rope_theta is not None and self.window else 0  # Gemma's local RoPE

    def forward(self, x, rope, kv_cache, attn):
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, -1, self.head_dim)  # [T, H + 2 * KVH, d]
        rotated = self.num_heads + self.num_kv_heads
        q, k, v = qkv[:, :self.num_heads], qkv[:, self.num_heads:rotated], qkv[:, rotated:]
        if self.q_norm is not None and self.qk_norm_across_heads:  # rows of all heads (the native stack's too)
            q = self.q_norm(q.reshape(t, -1)).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(t, -1)).view(t, self.num_kv_heads, self.head_dim)
        elif self.q_norm is not None:  # per head, over rows of head_dim (the native stack does the same rows)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.num_kv_heads, self.head_dim)
        if attn.fuses_rope:  # the backend rotates q and k in place as it stores k
            out = attn.forward(q, k, v, kv_cache, self.scale, rope=rope.table, window=self.window)
        elif self.q_norm is None:
            qk = apply_rotary(qkv[:, :rotated], rope.cos, rope.sin)  # q and k heads rotated in one go
            out = attn.forward(qk[:, :self.num_heads], qk[:, self.num_heads:], v, kv_cache, self.scale,
                               window=self.window)
        else:
            out = attn.forward(apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin), v,
                               kv_cache, self.scale, window=self.window)
        return self.o_proj(out.reshape(-1, self.q_size))


class GatedMLP(nn.Module):
    """gate_up, the activation, down; ``intermediate_size`` (None: the config's) for a mixture's experts."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.activation = cfg.activation
        self.kernels = None  # native CPU kernels for the activation (models.cpu_layout.prepare_for_cpu)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.activation == "silu":
            return self.down_proj(silu_and_mul(gate_up, self.kernels))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = DecoderAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if cfg.sandwich_norms else None
        if cfg.moe is None:
            self.mlp = GatedMLP(cfg)
        else:
            self.mlp = SparseMoE(cfg, lambda: GatedMLP(cfg, cfg.moe.intermediate_size))

    def forward(self, x, residual, ropes, kv_cache, attn):
        """x: the previous layer's output, still to be added to the residual stream (None at layer 0, where x is
        the embeddings). Returns (this layer's output, residual): the adds are fused into the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, ropes[self.self_attn.rope_index], kv_cache, attn)
        if self.pre_feedforward_layernorm is None:
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class DecoderForCausalLM(nn.Module):
    """forward(input_ids[T], positions[T], kv_caches, attn) -> hidden [T, hidden]; compute_logits(hidden)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings or not cfg.has_lm_head else \
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      rotary_dim=cfg.rotary_dim)
        self.local_rotary = None if cfg.local_rope_theta is None else RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta, None, rotary_dim=cfg.rotary_dim)
        # every layer in one native call for decode-sized steps (models.native_stack; set by prepare_for_cpu)
        self.native_stack = None
        # the step's LoRA rows (layers.lora.LoRAStep; set by models.lora_model), which the native stack runs too
        self.lora = None
        self._qk_rows = None  # the q/k row order of partial rotary (partial_rotary_order), by fused row
        self.cut_flag: CutFlag | None = None  # read between layers: a step cut short (models.step_cut)

    def forward(self, input_ids, positions, kv_caches, attn):
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:  # Gemma: the scale rounded to the weights' dtype, as HF does
            x = x * torch.tensor(self.config.embed_scale, dtype=torch.float32).to(x.dtype)
        ropes = [r.lookup(positions, fused=attn.fuses_rope) for r in (self.rotary, self.local_rotary) if r]
        cut = self.cut_flag
        if self.native_stack is not None and self.native_stack.accepts(x.shape[0], attn, self.lora):
            x, residual = self.native_stack.run(x, ropes[0].table, kv_caches, attn, cut)
            return self.norm(x, residual)[0]
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if cut is not None:
                cut.check(i)
            x, residual = layer(x, residual, ropes, kv_cache, attn)
        return self.norm(x, residual)[0]

    def get_input_embeddings(self) -> Embedding:
        return self.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:  # on CPU always: prepare_for_cpu gives a tied model its own packed head
            logits = self.lm_head(hidden)
        else:
            logits = F.linear(hidden, self.embed_tokens.weight)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def qk_row_order(self) -> torch.Tensor | None:
        """The order of qkv_proj's rows the model computes in, as indices into the checkpoint's (None: as stored):
        each q and k head's rows laid out for partial rotary (``layers.rotary.partial_rotary_order``)."""
        cfg = self.config
        if cfg.rotary_dim is None:
            return None
        if self._qk_rows is None:
            head = torch.tensor(partial_rotary_order(cfg.head_dim, cfg.rotary_dim), device="cpu")
            heads = cfg.num_heads + cfg.num_kv_heads
            qk = (torch.arange(heads, device="cpu").unsqueeze(1) * cfg.head_dim + head).reshape(-1)
            v = torch.arange(heads * cfg.head_dim, (heads + cfg.num_kv_heads) * cfg.head_dim, device="cpu")
            self._qk_rows = torch.cat([qk, v])
        return self._qk_rows

    def map_weight(self, name: str) -> WeightTarget | None:
        """Where HF checkpoint weight ``name`` goes (None: skip it). q/k/v and gate/up fill rows of fused ones;
        q/k rows come in ``qk_row_order``; Gemma's norms store ``w`` for a layer that multiplies by 1 + w."""
        cfg = self.config
        name = name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None  # recomputed buffers; tied lm_head copies some checkpoints store anyway
        shift = cfg.norm_offset if name.endswith("norm.weight") else 0.0
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        if cfg.moe is not None and ".experts." in name:
            inter = cfg.moe.intermediate_size
        rows = self.qk_row_order()
        for short, fused, offset, count in (("q_proj", "qkv_proj", 0, q), ("k_proj", "qkv_proj", q, kv),
                                            ("v_proj", "qkv_proj", q + kv, kv), ("gate_proj", "gate_up_proj", 0, inter),
                                            ("up_proj", "gate_up_proj", inter, inter)):
            if f".{short}." in name:
                order = None if rows is None or short not in ("q_proj", "k_proj") else \
                    rows[offset:offset + count] - offset
                return WeightTarget(name.replace(short, fused), offset, count, row_order=order)
        if ".qkv_proj." in name and rows is not None:
            return WeightTarget(name, row_order=rows)
        if (".q_norm." in name or ".k_norm." in name) and rows is not None:
            if cfg.qk_norm_across_heads:  # the whole q's (k's) rows, as qkv_proj's are ordered
                part = rows[:q] if ".q_norm." in name else rows[q:q + kv] - q
                return WeightTarget(name, row_order=part, shift=shift)
            return WeightTarget(name, row_order=rows[:cfg.head_dim], shift=shift)
        return WeightTarget(name, shift=shift)


# llama.cpp's per-layer tensor names (after "blk.N.") -> Hugging Face's (after "model.layers.N.") for this decoder
LLAMA_GGUF_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
