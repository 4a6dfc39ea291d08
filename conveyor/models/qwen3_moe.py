"""Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-235B-A22B) on the shared decoder: Qwen3's attention (an
RMSNorm on each q and k head) and a routed MLP on every layer (``models.moe``): softmax over ``num_experts``, the
``num_experts_per_tok`` largest, renormalised when ``norm_topk_prob`` (every published Qwen3-MoE sets it).

GGUF: llama.cpp's "qwen3moe" (NeoX RoPE, q/k rows as stored), experts in ``ffn_*_exps``; llama.cpp's graph always
renormalises the top-k weights, and the converter records no ``norm_topk_prob``, so a file is computed that way.
Refused: dense layers among the routed ones (``mlp_only_layers``, ``decoder_sparse_step``), Qwen2-MoE's shared
expert (another architecture, unsupported as a whole).
"""

from __future__ import annotations

from conveyor.models import gguf_config, hf_config, moe_config
from conveyor.models.config import ModelConfig
from conveyor.models.decoder import LLAMA_GGUF_TENSORS, DecoderForCausalLM
from conveyor.models.family import ModelFamily


def from_hf(c: hf_config.HFConfig, architecture: str) -> ModelConfig:
    moe = moe_config.from_hf(c, "num_experts", "moe_intermediate_size", norm_topk_prob=None)
    return hf_config.decoder_config(c, architecture, "qwen3_moe", qk_norm=True, moe=moe)


def from_gguf(m: gguf_config.GGUFMeta) -> ModelConfig:
    return gguf_config.decoder_config(m, "Qwen3MoeForCausalLM", "qwen3_moe", qk_norm=True,
                                      moe=moe_config.from_gguf(m, norm_topk_prob=True))


FAMILY = ModelFamily(
    name="qwen3_moe", hf_architectures=("Qwen3MoeForCausalLM",), config_from_hf=from_hf, build=DecoderForCausalLM,
    gguf_architectures=("qwen3moe",), config_from_gguf=from_gguf,
    gguf_tensors={**LLAMA_GGUF_TENSORS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                  **moe_config.EXPERT_TENSORS})
