"""OLMoE (``OlmoeForCausalLM``: OLMoE-1B-7B) on the shared decoder: RMSNorms on q and k that span all heads (one norm
over the whole q projection and one over the whole k, before RoPE; ``ModelConfig.qk_norm_across_heads``) and a
routed MLP on every layer (``models.moe``): softmax over ``num_experts``, the ``num_experts_per_tok`` largest, not
renormalised unless ``norm_topk_prob`` (OLMoE's is false). The experts' width is ``intermediate_size``.

GGUF: llama.cpp's "olmoe" (NeoX RoPE, q/k rows as stored), experts in ``ffn_*_exps``; llama.cpp's graph never
renormalises the top-k weights. Refused: ``clip_qkv`` (q/k/v clamping is not computed).
"""

from __future__ import annotations

from conveyor.models import gguf_config, hf_config, moe_config
from conveyor.models.config import ModelConfig
from conveyor.models.decoder import LLAMA_GGUF_TENSORS, DecoderForCausalLM
from conveyor.models.family import ModelFamily


def from_hf(c: hf_config.HFConfig, architecture: str) -> ModelConfig:
    if c.get("clip_qkv") is not None:
        c.refuse("clip_qkv", "clamping q, k and v is not computed")
    moe = moe_config.from_hf(c, "num_experts", "intermediate_size", norm_topk_prob=None)
    return hf_config.decoder_config(c, architecture, "olmoe", qk_norm=True, qk_norm_across_heads=True, moe=moe)


def from_gguf(m: gguf_config.GGUFMeta) -> ModelConfig:
    if m.get("attention.clamp_kqv"):
        m.refuse("attention.clamp_kqv", "clamping q, k and v is not computed")
    return gguf_config.decoder_config(m, "OlmoeForCausalLM", "olmoe", qk_norm=True, qk_norm_across_heads=True,
                                      moe=moe_config.from_gguf(m, norm_topk_prob=False,
                                                               width_key="feed_forward_length"))


FAMILY = ModelFamily(
    name="olmoe", hf_architectures=("OlmoeForCausalLM",), config_from_hf=from_hf, build=DecoderForCausalLM,
    gguf_architectures=("olmoe",), config_from_gguf=from_gguf,
    gguf_tensors={**LLAMA_GGUF_TENSORS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                  **moe_config.EXPERT_TENSORS})
