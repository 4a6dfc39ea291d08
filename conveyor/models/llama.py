"""The Llama family: Llama 2 and 3.x (SmolLM, TinyLlama ...), Mistral (a sliding window on every layer) and
Ministral (per-layer windows from ``layer_types``), on the shared decoder (``models.decoder``).

GGUF: llama.cpp's "llama" architecture, q/k rows permuted by its converter; Llama 3's scaling as ``rope_freqs``.
llama.cpp's converter drops Mistral's ``sliding_window`` (llama.cpp runs every "llama" file with full attention);
a file that carries ``llama.attention.sliding_window`` gets it on every layer, as transformers computes Mistral.
"""

from __future__ import annotations

from conveyor.models import gguf_config, hf_config
from conveyor.models.config import ModelConfig
from conveyor.models.decoder import LLAMA_GGUF_TENSORS, DecoderForCausalLM
from conveyor.models.family import ModelFamily


def from_hf(c: hf_config.HFConfig, architecture: str) -> ModelConfig:
    cfg = hf_config.decoder_config(c, architecture, "llama")
    if architecture.startswith("Llama"):  # transformers' Llama attends to every key whatever sliding_window says
        cfg.layer_windows = ()
    return cfg


def from_gguf(m: gguf_config.GGUFMeta) -> ModelConfig:
    return gguf_config.decoder_config(m, "LlamaForCausalLM", "llama",
                                      layer_windows=gguf_config.window_on_every_layer(m))


FAMILY = ModelFamily(
    name="llama", hf_architectures=("LlamaForCausalLM", "MistralForCausalLM", "MinistralForCausalLM"),
    config_from_hf=from_hf, build=DecoderForCausalLM, gguf_architectures=("llama",), config_from_gguf=from_gguf,
    gguf_tensors=LLAMA_GGUF_TENSORS, gguf_consumed=("rope_freqs.weight",), gguf_permuted_qk=True)
