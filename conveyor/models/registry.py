"""The model registry: every family conveyor computes, each declared by its own module as a ``ModelFamily``
(``models.family``).

A family says how it reads a Hugging Face config.json (``config_from_hf``) and a GGUF file's metadata
(``config_from_gguf``), which GGUF architecture names and llama.cpp tensor names it maps (and whether llama.cpp's
converter permuted its q/k rows for GPT-J-style RoPE), and how its layers are built (``build``). The loader, the
GGUF reader, ``build_model`` and the simulator's ``ModelSpec`` (``ModelConfig.spec``) ask the registry; adding a
family is its own module plus one entry in ``FAMILIES``.

What a checkpoint holds that no family computes is refused at load, naming the field: an unknown architecture, a
config key or GGUF metadata key no reader marked (``hf_config.HFConfig.finish``, ``gguf_config.GGUFMeta.finish``),
an unknown RoPE type or parameter, a tensor without a place (``gguf_model``), and what a family refuses itself
(a vision tower, attention soft-capping).

How a mixture-of-experts family plugs in (Qwen3-MoE, Mixtral, OLMoE; not built yet): its module reads the router's
config (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``; GGUF
``{arch}.expert_count`` / ``expert_used_count`` / ``expert_feed_forward_length``) into ModelConfig fields of its own
(today ``finish`` refuses them, so an MoE checkpoint can never load as a dense one), and its layers replace
``decoder.GatedMLP`` with a routed MLP module (router linear, top-k, experts' gate_up and down as stacked 3-D weights
grouped by expert); ``gguf_tensors`` maps ``ffn_gate_inp`` (router) and ``ffn_gate_exps`` / ``ffn_up_exps`` /
``ffn_down_exps`` (3-D, kept in their quantized blocks by ``models.quantize`` once it plans 3-D weights), and its
map_weight stacks HF's per-expert ``experts.N.gate_proj`` into the 3-D parameters by expert offset. The native layer
stack declines it by its declared check (``native_stack.unsupported_reason``: the MLP is not a dense gated MLP), and
``sim.model_specs.ModelSpec`` gains the expert counts so the FLOP count charges the experts a token runs.
"""

from __future__ import annotations

from conveyor.models import bert, gemma3, gpt2, llama, phi3, qwen
from conveyor.models.config import ModelConfig
from conveyor.models.family import CausalLM, ModelFamily
from conveyor.models.gguf_config import GGUFMeta
from conveyor.models.gguf_file import GGUFError
from conveyor.models.hf_config import HFConfig


FAMILIES: tuple[ModelFamily, ...] = (llama.FAMILY, qwen.QWEN2, qwen.QWEN3, gemma3.FAMILY, phi3.FAMILY, gpt2.FAMILY,
                                     bert.FAMILY)


def family_named(name: str) -> ModelFamily:
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise KeyError(f"no model family {name!r}")


def supported_architectures() -> list[str]:
    return [a for fam in FAMILIES for a in fam.hf_architectures]  # (and each *ForCausalLM's bare *Model)


def config_from_hf(raw: dict, where: str = "config.json") -> ModelConfig:
    """A config.json dict -> ModelConfig through its family; ValueError naming ``where`` and the field for an
    unsupported architecture or a setting no family computes."""
    archs = raw.get("architectures") or []
    for fam in FAMILIES:
        for arch in archs:
            if arch in fam.refused_architectures:
                raise ValueError(f"{where}: {arch} is not supported: {fam.refused_architectures[arch]}")
    found = [(fam, a) for a in archs for fam in FAMILIES if a in fam.hf_architectures or _causal_lm_of(a) in
             fam.hf_architectures]
    if not found:
        raise ValueError(f"{where}: unsupported architecture {archs or raw.get('model_type')!r}; "
                         f"supported: {', '.join(supported_architectures())}")
    fam, arch = found[0]
    reader = HFConfig(raw, where)
    cfg = fam.config_from_hf(reader, arch)
    reader.finish()
    if arch not in fam.hf_architectures:  # a decoder's bare ``*Model``: the same layers without the LM head
        cfg.has_lm_head = False
    return cfg


def _causal_lm_of(architecture: str) -> str | None:
    """``Qwen3Model`` -> ``Qwen3ForCausalLM``: a decoder checkpoint saved without its LM head (an embedder, as
    Qwen3-Embedding and e5-mistral ship), served by its causal family's layers."""
    return architecture.removesuffix("Model") + "ForCausalLM" if architecture.endswith("Model") else None


def config_from_gguf(f) -> tuple[ModelConfig, ModelFamily]:
    """A GGUF file's ModelConfig and family, by ``general.architecture``; GGUFError naming what is refused."""
    arch = f.get("general.architecture")
    for fam in FAMILIES:
        if arch in fam.gguf_architectures:
            meta = GGUFMeta(f)
            cfg = fam.config_from_gguf(meta)
            meta.finish()
            return cfg, fam
    known = [a for fam in FAMILIES for a in fam.gguf_architectures]
    raise GGUFError(f"{f.path}: unsupported architecture {arch!r}; supported GGUF architectures: {', '.join(known)}")


def build(cfg: ModelConfig) -> CausalLM:
    return family_named(cfg.family).build(cfg)
