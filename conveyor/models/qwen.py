"""The Qwen families on the shared decoder: Qwen2 / Qwen2.5 (biases on q, k and v) and Qwen3 (RMSNorm on each q
and k head before RoPE, an explicit head_dim). Windows (``use_sliding_window`` with ``max_window_layers``, or
``layer_types``) as transformers builds them. GGUF: llama.cpp's "qwen2" / "qwen3", q/k rows as stored (NeoX RoPE).
"""

from __future__ import annotations

from conveyor.models import gguf_config, hf_config
from conveyor.models.config import ModelConfig
from conveyor.models.decoder import LLAMA_GGUF_TENSORS, DecoderForCausalLM
from conveyor.models.family import ModelFamily


def qwen2_from_hf(c: hf_config.HFConfig, architecture: str) -> ModelConfig:
    return hf_config.decoder_config(c, architecture, "qwen2", qkv_bias=True, o_bias=False)


def qwen3_from_hf(c: hf_config.HFConfig, architecture: str) -> ModelConfig:
    return hf_config.decoder_config(c, architecture, "qwen3", qk_norm=True)


def qwen2_from_gguf(m: gguf_config.GGUFMeta) -> ModelConfig:
    return gguf_config.decoder_config(m, "Qwen2ForCausalLM", "qwen2")


def qwen3_from_gguf(m: gguf_config.GGUFMeta) -> ModelConfig:
    return gguf_config.decoder_config(m, "Qwen3ForCausalLM", "qwen3", qk_norm=True)


QWEN2 = ModelFamily(name="qwen2", hf_architectures=("Qwen2ForCausalLM",), config_from_hf=qwen2_from_hf,
                    build=DecoderForCausalLM, gguf_architectures=("qwen2",), config_from_gguf=qwen2_from_gguf,
                    gguf_tensors=LLAMA_GGUF_TENSORS)
QWEN3 = ModelFamily(name="qwen3", hf_architectures=("Qwen3ForCausalLM",), config_from_hf=qwen3_from_hf,
                    build=DecoderForCausalLM, gguf_architectures=("qwen3",), config_from_gguf=qwen3_from_gguf,
                    gguf_tensors={**LLAMA_GGUF_TENSORS, "attn_q_norm": "self_attn.q_norm",
                                  "attn_k_norm": "self_attn.k_norm"})
