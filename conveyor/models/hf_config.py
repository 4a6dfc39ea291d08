"""Reading a Hugging Face config.json for a model family: the keys every decoder family shares, RoPE parameters in
transformers 4's and 5's formats, per-layer sliding windows, and the refusal of what conveyor does not compute.

``HFConfig`` marks every key a family reads or accepts; ``finish`` refuses any other key whose value is not
neutral (None, False, 0, empty), naming it: a key conveyor does not know may change the model's math, and a
refusal is better than a silent wrong answer.
"""

from __future__ import annotations

from conveyor.layers.rope_scaling import ROPE_KEYS
from conveyor.models.config import ModelConfig

# Keys that never change a forward pass: metadata, training-only settings, generation defaults, caching hints.
HARMLESS_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "auto_map",
    "use_cache", "initializer_range", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
    "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id", "pretraining_tp",
    "tie_word_embeddings", "output_attentions", "output_hidden_states", "return_dict", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params", "cache_implementation",
    "chunk_size_feed_forward", "is_decoder", "add_cross_attention", "tf_legacy_loss", "use_bfloat16",
    "torchscript", "pruned_heads", "finetuning_task", "num_labels", "max_length", "min_length", "do_sample",
    "temperature", "top_k", "top_p", "num_beams", "repetition_penalty", "bad_words_ids", "forced_bos_token_id",
    "forced_eos_token_id", "_attn_implementation_autoset", "unsloth_fixed", "keys_to_ignore_at_inference",
    "bos_token", "eos_token",
    "is_llama_config", "transformers.js_config",  # SmolLM2's config carries these markers
    "_model_name_or_path",  # transformers' GGUF import writes the file's general.name here
    "matryoshka_dimensions", "is_matryoshka",  # which embedding lengths a pooling model serves (pooling_config)
})
_NEUTRAL = (None, False, 0, 0.0, "", [], {})
SLIDING, FULL = "sliding_attention", "full_attention"


class HFConfig:
    """A config.json dict as a family reads it (see module doc). ValueError names ``where`` and the key."""

    def __init__(self, raw: dict, where: str) -> None:
        self.raw, self.where = raw, where
        self.used: set[str] = set(HARMLESS_KEYS)

    def get(self, key: str, default=None):
        self.used.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def require(self, key: str):
        if self.raw.get(key) is None:
            raise ValueError(f"{self.where}: the key {key!r} is missing")
        return self.get(key)

    def expect(self, key: str, *allowed, why: str = "") -> None:
        """Accept ``key`` only absent or with one of the ``allowed`` values (what conveyor computes)."""
        value = self.get(key)
        if value is not None and value not in allowed:
            self.refuse(key, why or f"conveyor computes only {', '.join(map(repr, allowed))}")

    def refuse(self, key: str, why: str):
        raise ValueError(f"{self.where}: {key}={self.raw.get(key)!r} is not supported: {why}")

    def finish(self) -> None:
        """Refuse every key no reader marked whose value is not neutral."""
        for key, value in self.raw.items():
            if key not in self.used and value not in _NEUTRAL:
                raise ValueError(f"{self.where}: {key}={value!r} is a setting conveyor does not know; it may change "
                                 "the model's math, so the model is refused rather than computed wrongly")


def rope_parameters(c: HFConfig, params: dict | None = None, max_positions: int = 0) -> tuple[float, dict | None,
                                                                                               float]:
    """(theta, normalised scaling or None, partial_rotary_factor) from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor`` (transformers 4); ``params``: one layer type's
    parameters of a per-type dict. Unknown RoPE types and parameters are refused, naming them."""
    merged = {**(c.get("rope_scaling") or {}), **(params if params is not None else c.get("rope_parameters") or {})}
    theta = float(merged.pop("rope_theta", None) or c.get("rope_theta", 10000.0))
    partial = float(merged.pop("partial_rotary_factor", None) or c.get("partial_rotary_factor", 1.0))
    kind = merged.pop("rope_type", None) or merged.get("type") or "default"
    merged.pop("type", None)
    kind = {"su": "longrope"}.get(kind, kind)
    if kind not in ROPE_KEYS:
        c.refuse("rope_parameters", f"RoPE type {kind!r} is unknown to conveyor (known: {', '.join(ROPE_KEYS)})")
    unknown = sorted(set(merged) - ROPE_KEYS[kind])
    if unknown:
        c.refuse("rope_parameters", f"{kind} RoPE with parameters conveyor does not compute: {', '.join(unknown)}")
    original = c.get("original_max_position_embeddings")  # (Phi-3 keeps it beside the scaling; only scalings read it)
    if kind in ("yarn", "longrope", "llama3") and not merged.get("original_max_position_embeddings"):
        merged["original_max_position_embeddings"] = original or max_positions
    return theta, (None if kind == "default" else {"rope_type": kind, **merged}), partial


def layer_windows(c: HFConfig, num_layers: int, max_positions: int) -> tuple[int, ...]:
    """Each layer's sliding window from ``layer_types`` or ``sliding_window`` (with Qwen's ``use_sliding_window`` and
    ``max_window_layers``), as transformers builds them; () when no layer has one (a window as long as the context
    is none)."""
    window = int(c.get("sliding_window") or 0)
    use = c.get("use_sliding_window", True)
    types = c.get("layer_types")
    first_windowed = c.get("max_window_layers", 0) if "use_sliding_window" in c.raw else 0
    c.get("max_window_layers")  # (read only beside use_sliding_window, as transformers reads it)
    if not use:
        window = 0
    if types is None:
        types = [SLIDING if window and i >= first_windowed else FULL for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {SLIDING, FULL}:
        c.refuse("layer_types", f"expected {num_layers} entries of {SLIDING!r} / {FULL!r}")
    if SLIDING in types and not window:
        c.refuse("layer_types", "sliding_attention layers without a sliding_window")
    windows = tuple(window if t == SLIDING and window < max_positions else 0 for t in types)
    return windows if any(windows) else ()


def decoder_config(c: HFConfig, architecture: str, family: str, **features) -> ModelConfig:
    """The shared part of a decoder family's config (shape, norms, RoPE, windows, biases, special tokens);
    ``features`` sets the ModelConfig fields the family decides itself."""
    heads = c.require("num_attention_heads")
    hidden = c.require("hidden_size")
    layers = c.require("num_hidden_layers")
    max_pos = c.get("max_position_embeddings", 4096)
    head_dim = c.get("head_dim") or hidden // heads
    theta, scaling, partial = rope_parameters(c, max_positions=max_pos)
    rotary = int(head_dim * partial)
    if rotary % 2 or (head_dim - rotary) % 2:
        c.refuse("partial_rotary_factor", f"a rotary part of {rotary} of {head_dim} dims is not whole pairs")
    c.expect("hidden_act", "silu", why="the gated MLP runs SiLU")
    c.expect("rope_interleaved", False, why="RoPE rotates the two halves of each head (NeoX), not adjacent pairs")
    c.expect("mlp_bias", False, True)
    bias = bool(c.get("attention_bias", False))
    eos = c.get("eos_token_id")
    fields = dict(
        architecture=architecture, family=family, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
        intermediate_size=c.require("intermediate_size"), vocab_size=c.require("vocab_size"),
        max_position_embeddings=max_pos, norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), rope_theta=theta, rope_scaling=scaling,
        rotary_dim=rotary if rotary != head_dim else None, layer_windows=layer_windows(c, layers, max_pos),
        qkv_bias=bias, o_bias=bias, mlp_bias=bool(c.get("mlp_bias", False)), bos_token_id=c.get("bos_token_id"),
        eos_token_ids=[int(t) for t in (eos if isinstance(eos, list) else [eos])] if eos is not None else [])
    fields.update(features)
    return ModelConfig(**fields)
