"""A normalised view of a Hugging Face config.json: the handful of numbers our model files need."""

from __future__ import annotations

from dataclasses import dataclass, field

LLAMA_LIKE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
GPT2_LIKE = {"GPT2LMHeadModel": "gpt2"}
SUPPORTED_ARCHITECTURES = tuple(LLAMA_LIKE) + tuple(GPT2_LIKE)


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(t) for t in (x if isinstance(x, (list, tuple)) else [x])]


def _rope(raw: dict) -> tuple[float, dict | None]:
    """Rope theta and scaling from either transformers-4 keys or transformers-5 ``rope_parameters``."""
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    """Validate and normalise a config dict; ValueError naming ``where`` for an unsupported architecture."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        by_type = {v: k for k, v in {**LLAMA_LIKE, **GPT2_LIKE}.items()}
        arch = by_type.get(raw.get("model_type", ""))
    if arch is None:
        raise ValueError(f"{where}: unsupported architecture {archs or raw.get('model_type')!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    common = dict(bos_token_id=raw.get("bos_token_id"), eos_token_ids=_as_list(raw.get("eos_token_id")),
                  vocab_size=raw["vocab_size"])
    if arch in GPT2_LIKE:
        hidden, heads = raw["n_embd"], raw["n_head"]
        if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("reorder_and_upcast_attn"):
            raise ValueError(f"{where}: GPT-2 attention variants (scale_attn_by_inverse_layer_idx, "
                             "reorder_and_upcast_attn) are not supported")
        return ModelConfig(architecture=arch, hidden_size=hidden, num_layers=raw["n_layer"], num_heads=heads,
                           num_kv_heads=heads, head_dim=hidden // heads,
                           intermediate_size=raw.get("n_inner") or 4 * hidden,
                           max_position_embeddings=raw["n_positions"], norm_eps=raw.get("layer_norm_epsilon", 1e-5),
                           tie_word_embeddings=raw.get("tie_word_embeddings", True), **common)
    heads = raw["num_attention_heads"]
    theta, scaling = _rope(raw)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    return ModelConfig(
        architecture=arch, hidden_size=raw["hidden_size"], num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw["intermediate_size"], max_position_embeddings=raw.get("max_position_embeddings", 4096),
        norm_eps=raw.get("rms_norm_eps", 1e-6), tie_word_embeddings=raw.get("tie_word_embeddings", False),
        rope_theta=theta, rope_scaling=scaling,
        qkv_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
        o_bias=(not is_qwen2) and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)), **common)
