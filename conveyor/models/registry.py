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

The mixture-of-experts families (``qwen3_moe``, ``mixtral``, ``olmoe``) read their router (``models.moe_config``:
``num_experts``, ``num_experts_per_tok``, the experts' width, ``norm_topk_prob``; GGUF ``{arch}.expert_count`` /
``expert_used_count`` / ``expert_feed_forward_length``) into ``ModelConfig.moe`` (a dense family's reader never
marks those keys, so ``finish`` refuses an MoE checkpoint under a dense family), and the shared decoder builds a
routed MLP (``models.moe.SparseMoE``: a router and one ordinary gated MLP per expert) in place of the dense one.
``gguf_tensors`` maps ``ffn_gate_inp`` (the router) and the 3-D ``ffn_gate_exps`` / ``ffn_up_exps`` /
``ffn_down_exps``, one Hugging Face name per expert (``{expert}``, ``gguf_model.gguf_parts``), each expert's slice
kept in its quantized blocks by ``models.quantize``. ``ModelConfig.spec`` carries the expert counts, so the FLOP
count charges the experts a token runs and the simulator the bytes of the experts a step chooses.
"""

from __future__ import annotations

from conveyor.models import bert, gemma3, gpt2, llama, mixtral, olmoe, phi3, qwen, qwen3_moe
from conveyor.models.config import ModelConfig
from conveyor.models.family import CausalLM, ModelFamily
from conveyor.models.gguf_config import GGUFMeta
from conveyor.models.gguf_file import GGUFError
from conveyor.models.hf_config import HFConfig


# (mixtral before llama: of the "llama" GGUF files, it takes those with experts)
FAMILIES: tuple[ModelFamily, ...] = (mixtral.FAMILY, llama.FAMILY, qwen.QWEN2, qwen.QWEN3, gemma3.FAMILY, phi3.FAMILY,
                                     gpt2.FAMILY, bert.FAMILY, qwen3_moe.FAMILY, olmoe.FAMILY)


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
        if arch in fam.gguf_architectures and (fam.gguf_accepts is None or fam.gguf_accepts(f)):
            meta = GGUFMeta(f)
            cfg = fam.config_from_gguf(meta)
            meta.finish()
            return cfg, fam
    known = dict.fromkeys(a for fam in FAMILIES for a in fam.gguf_architectures)
    raise GGUFError(f"{f.path}: unsupported architecture {arch!r}; supported GGUF architectures: {', '.join(known)}")


def build(cfg: ModelConfig) -> CausalLM:
    return family_named(cfg.family).build(cfg)
