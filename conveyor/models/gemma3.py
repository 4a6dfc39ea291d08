"""Gemma 3 (text: ``Gemma3ForCausalLM``) on the shared decoder: local (sliding-window) layers interleaved with
global ones (``layer_types``, or every ``sliding_window_pattern``-th layer global), two RoPE bases (the global
layers' ``rope_theta`` with its scaling, the local layers' own base unscaled), RMSNorm on q and k heads, four norms
a layer, norms that multiply by 1 + w, embeddings times sqrt(hidden), tanh-GELU, the attention scale
``query_pre_attn_scalar ** -0.5``, and final logit soft-capping where the config sets it.

Refused: Gemma 3's multimodal checkpoint (``Gemma3ForConditionalGeneration``: a vision tower) and Gemma 2, whose
attention-logit soft-capping no attention backend computes. GGUF: llama.cpp's "gemma3" (its norms already hold
1 + w), the window pattern from ``gemma3.attention.sliding_window_pattern`` or, as llama.cpp takes it, every 6th
layer global; the attention scale as llama.cpp derives it (head_dim ** -0.5; hidden / heads for the 62-layer 27B).
"""

from __future__ import annotations

import math

from conveyor.models import gguf_config, hf_config
from conveyor.models.config import ModelConfig
from conveyor.models.decoder import DecoderForCausalLM
from conveyor.models.family import ModelFamily

_PATTERN = 6  # llama.cpp's and transformers' default: every 6th layer global


def from_hf(c: hf_config.HFConfig, architecture: str) -> ModelConfig:
    c.expect("hidden_activation", "gelu_pytorch_tanh", "gelu_tanh", why="the MLP runs tanh-GELU")
    c.expect("hidden_act", "gelu_pytorch_tanh", "gelu_tanh", why="the MLP runs tanh-GELU")
    c.expect("use_bidirectional_attention", False, why="attention is causal")
    if c.get("attn_logit_softcapping") is not None:
        c.refuse("attn_logit_softcapping", "attention-logit soft-capping is not computed by the attention backends")
    params = c.get("rope_parameters") or {}
    layers = c.require("num_hidden_layers")
    pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or _PATTERN
    if "layer_types" not in c.raw and "sliding_window" in c.raw:  # transformers 4 configs: a pattern
        every = int(pattern)
        c.raw = {**c.raw, "layer_types": [hf_config.SLIDING if (i + 1) % every else hf_config.FULL
                                          for i in range(layers)]}
    local_theta = c.get("rope_local_base_freq", 10000.0)
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: per layer type
        local = dict(params.get("sliding_attention") or {})
        if local.pop("rope_type", "default") != "default" or set(local) - {"rope_theta"}:
            c.refuse("rope_parameters", "the local layers' RoPE is computed unscaled")
        local_theta = local.get("rope_theta", local_theta)
        c.raw = {**c.raw, "rope_parameters": params.get("full_attention") or {}}
    cfg = hf_config.decoder_config(
        c, architecture, "gemma3", qk_norm=True, sandwich_norms=True, norm_offset=1.0, activation="gelu_tanh",
        local_rope_theta=float(local_theta), attn_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcap=c.get("final_logit_softcapping"), tie_word_embeddings=c.get("tie_word_embeddings", True))
    cfg.embed_scale = math.sqrt(cfg.hidden_size)
    return cfg


def from_gguf(m: gguf_config.GGUFMeta) -> ModelConfig:
    layers = int(m.require("block_count"))
    window = int(m.get("attention.sliding_window", 0))
    pattern = m.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        local = [bool(p) for p in pattern]
    else:
        every = int(pattern or _PATTERN)
        local = [(i + 1) % every != 0 for i in range(layers)]
    windows = tuple(window if w else 0 for w in local) if window else ()
    hidden, heads = int(m.require("embedding_length")), int(m.require("attention.head_count"))
    head_dim = int(m.get("attention.key_length", hidden // heads))
    scale = m.get("attention.scale")
    if scale is None:
        scale = (hidden / heads) ** -0.5 if layers == 62 else head_dim ** -0.5
    swa_theta = m.get("rope.freq_base_swa", 10000.0)
    cfg = gguf_config.decoder_config(
        m, "Gemma3ForCausalLM", "gemma3", layer_windows=windows, qk_norm=True, sandwich_norms=True,
        activation="gelu_tanh", local_rope_theta=float(swa_theta), attn_scale=float(scale),
        final_logit_softcap=m.get("final_logit_softcapping"))
    cfg.embed_scale = math.sqrt(cfg.hidden_size)
    return cfg


FAMILY = ModelFamily(
    name="gemma3", hf_architectures=("Gemma3ForCausalLM",), config_from_hf=from_hf, build=DecoderForCausalLM,
    gguf_architectures=("gemma3",), config_from_gguf=from_gguf,
    gguf_tensors={"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                  "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                  "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                  "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"},
    refused_architectures={
        "Gemma3ForConditionalGeneration": "the checkpoint holds a vision tower (vision_config); conveyor computes "
                                          "Gemma 3's text model only (Gemma3ForCausalLM)",
        "Gemma2ForCausalLM": "attn_logit_softcapping (Gemma 2's attention-logit soft-capping) is not computed by "
                             "the attention backends"})
