"""Mixtral (``MixtralForCausalLM``: Mixtral-8x7B, 8x22B) on the shared decoder: Mistral's attention (a sliding window
where the config sets one) and a routed MLP on every layer (``models.moe``): softmax over ``num_local_experts``, the
``num_experts_per_tok`` largest, always renormalised. The experts' width is ``intermediate_size``; the checkpoint's
``block_sparse_moe.experts.N.w1/w3/w2`` are the gate, up and down projections.

GGUF: llama.cpp writes Mixtral as its "llama" architecture with ``llama.expert_count`` and ``ffn_*_exps`` tensors
(q/k rows permuted, as every "llama" file's): this family reads the "llama" files that have experts
(``gguf_accepts``), the llama family the others.
"""

from __future__ import annotations

from conveyor.models import gguf_config, hf_config, moe_config
from conveyor.models.config import ModelConfig
from conveyor.models.decoder import LLAMA_GGUF_TENSORS, DecoderForCausalLM
from conveyor.models.family import ModelFamily
from conveyor.models.gguf_file import GGUFFile
from conveyor.models.weights import WeightTarget

# Mixtral's checkpoint names -> the shared decoder's (Qwen3-MoE's)
_RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


class MixtralForCausalLM(DecoderForCausalLM):
    def map_weight(self, name: str) -> WeightTarget | None:
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        return super().map_weight(name)


def from_hf(c: hf_config.HFConfig, architecture: str) -> ModelConfig:
    moe = moe_config.from_hf(c, "num_local_experts", "intermediate_size", norm_topk_prob=True)
    return hf_config.decoder_config(c, architecture, "mixtral", moe=moe)


def from_gguf(m: gguf_config.GGUFMeta) -> ModelConfig:
    return gguf_config.decoder_config(m, "MixtralForCausalLM", "mixtral",
                                      layer_windows=gguf_config.window_on_every_layer(m),
                                      moe=moe_config.from_gguf(m, norm_topk_prob=True,
                                                               width_key="feed_forward_length"))


def has_experts(f: GGUFFile) -> bool:
    return f.get("llama.expert_count") is not None


FAMILY = ModelFamily(
    name="mixtral", hf_architectures=("MixtralForCausalLM",), config_from_hf=from_hf, build=MixtralForCausalLM,
    gguf_architectures=("llama",), config_from_gguf=from_gguf, gguf_accepts=has_experts,
    gguf_tensors={**LLAMA_GGUF_TENSORS, **moe_config.EXPERT_TENSORS}, gguf_permuted_qk=True)
