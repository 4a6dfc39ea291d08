"""Phi-3 / Phi-3.5 / Phi-4-mini on the shared decoder: q/k/v stored fused (``qkv_proj``) and gate/up fused
(``gate_up_proj``, llama.cpp's ``ffn_up`` of twice the width), partial rotary (``partial_rotary_factor``; Phi-4-mini
rotates 3/4 of each head), LongRoPE for the long-context variants, a sliding window on every layer where the config
sets one (Phi-3-mini: 2047; transformers applies it, llama.cpp currently does not).
"""

from __future__ import annotations

from conveyor.models import gguf_config, hf_config
from conveyor.models.config import ModelConfig
from conveyor.models.decoder import DecoderForCausalLM
from conveyor.models.family import ModelFamily


def from_hf(c: hf_config.HFConfig, architecture: str) -> ModelConfig:
    # keys of Phi-4-mini's config that its reference code reads and whose values change nothing
    c.expect("full_attn_mod", 1, why="every layer full (with the config's sliding window) is what is computed")
    c.expect("interpolate_factor", 1, why="position interpolation is not computed")
    c.expect("lm_head_bias", False, why="an lm_head bias is not loaded")
    return hf_config.decoder_config(c, architecture, "phi3")


def from_gguf(m: gguf_config.GGUFMeta) -> ModelConfig:
    return gguf_config.decoder_config(m, "Phi3ForCausalLM", "phi3", layer_windows=gguf_config.window_on_every_layer(m))


FAMILY = ModelFamily(
    name="phi3", hf_architectures=("Phi3ForCausalLM",), config_from_hf=from_hf, build=DecoderForCausalLM,
    gguf_architectures=("phi3",), config_from_gguf=from_gguf,
    gguf_tensors={"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                  "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
                  "ffn_down": "mlp.down_proj"},
    gguf_consumed=("rope_factors_long.weight", "rope_factors_short.weight"),
    refused_architectures={"Phi4MMForCausalLM": "Phi-4-multimodal's audio and vision towers are not built"})
