"""Reading a GGUF file's metadata for a model family: the ``{arch}.*`` keys every decoder family shares (llama.cpp's
names), RoPE scaling as llama.cpp's converter writes it, and the refusal of what conveyor does not compute.

``GGUFMeta`` marks every ``{arch}.*`` key a family reads or accepts; ``finish`` refuses any other with a value that
is not neutral, naming it (``general.*``, ``tokenizer.*`` and ``quantize.*`` keys never change the math).
"""

from __future__ import annotations

import numpy as np

from conveyor.models.config import ModelConfig
from conveyor.models.gguf_file import GGUFError, GGUFFile

# {arch}.* keys that never change a forward pass (sizes checked elsewhere, llama.cpp's own bookkeeping)
HARMLESS = frozenset({"context_length", "vocab_size", "attention.value_length", "rope.scaling.finetuned",
                      "tensor_data_layout", "attention.causal"})
_NEUTRAL = (None, False, 0, 0.0, "", "none", [])


class GGUFMeta:
    """A GGUF file's metadata as a family reads it (see module doc)."""

    def __init__(self, f: GGUFFile) -> None:
        self.f, self.path = f, f.path
        self.arch = f.get("general.architecture")
        self.used = {f"{self.arch}.{k}" for k in HARMLESS}

    def get(self, name: str, default=None):
        key = f"{self.arch}.{name}"
        self.used.add(key)
        value = self.f.get(key)
        return default if value is None else value

    def require(self, name: str):
        value = self.get(name)
        if value is None:
            raise GGUFError(f"{self.path}: metadata key {self.arch}.{name} is missing")
        return value

    def refuse(self, name: str, why: str):
        raise GGUFError(f"{self.path}: {self.arch}.{name}={self.f.get(f'{self.arch}.{name}')!r} is not supported: "
                        f"{why}")

    def tensor(self, name: str) -> list[float] | None:
        """A small float tensor the metadata needs (RoPE factors), or None when the file has none."""
        if name not in self.f.tensors:
            return None
        return self.f.load(name).reshape(-1).tolist()

    def finish(self) -> None:
        for key, value in self.f.metadata.items():
            if key.startswith(f"{self.arch}.") and key not in self.used and _neutral(value) is False:
                raise GGUFError(f"{self.path}: metadata {key}={value!r} is a setting conveyor does not know; it may "
                                "change the model's math, so the model is refused rather than computed wrongly")


def _neutral(value) -> bool:
    if isinstance(value, (list, tuple, np.ndarray)):
        return len(value) == 0
    return any(value is n or (type(value) is type(n) and value == n) for n in _NEUTRAL) or value in (0, 0.0)


def rope_scaling(m: GGUFMeta, rotary_dim: int) -> dict | None:
    """The RoPE scaling llama.cpp's converter writes: ``rope.scaling.type`` (linear, yarn, longrope with its
    ``rope_factors_long/short`` tensors) or Llama 3's per-frequency divisors (``rope_freqs``)."""
    kind = m.get("rope.scaling.type", "none")
    if "rope_factors_long.weight" in m.f.tensors:  # llama.cpp's phi3 writes the factors and no type
        kind = "longrope"
    freqs = m.tensor("rope_freqs.weight")
    if freqs is not None:
        if kind not in ("none", None) or len(freqs) != rotary_dim // 2:
            m.refuse("rope.scaling.type", f"rope_freqs ({len(freqs)} values) beside a {kind} scaling")
        return {"rope_type": "freq_factors", "factors": freqs}
    factor = m.get("rope.scaling.factor")
    original = m.get("rope.scaling.original_context_length")
    attention = m.get("rope.scaling.attn_factor")
    if kind in ("none", None):
        if attention not in (None, 1.0):
            m.refuse("rope.scaling.attn_factor", "an attention factor without a RoPE scaling")
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
        for ours, theirs in (("beta_fast", "rope.scaling.yarn_beta_fast"), ("beta_slow", "rope.scaling.yarn_beta_slow"),
                             ("attention_factor", "rope.scaling.yarn_attn_factor")):
            if m.get(theirs) is not None:
                out[ours] = float(m.get(theirs))
        if m.get("rope.scaling.yarn_ext_factor") not in (None, 1.0):
            m.refuse("rope.scaling.yarn_ext_factor", "only YaRN's default extrapolation mix is computed")
        return out
    if kind == "longrope":
        long, short = m.tensor("rope_factors_long.weight"), m.tensor("rope_factors_short.weight")
        if long is None or short is None or not original:
            m.refuse("rope.scaling.type", "longrope without rope_factors_long/short or the original context length")
        return {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                "original_max_position_embeddings": int(original),
                "attention_factor": None if attention is None else float(attention)}
    m.refuse("rope.scaling.type", "conveyor computes linear, yarn, longrope and rope_freqs scalings")


def stop_token_ids(f: GGUFFile) -> list[int]:
    """End-of-generation ids: ``tokenizer.ggml.eos/eot/eom_token_id``, and, as llama.cpp finds them, control tokens
    whose text ends a turn (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``, ``<|end|>``, ``<|eom_id|>`` ...)
    that converters leave unnamed (they write one eos id)."""
    from conveyor.models.gguf_vocab import CONTROL, END_OF_TURN_TEXTS

    ids = {f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")}
    tokens = f.get("tokenizer.ggml.tokens") or []
    types = f.get("tokenizer.ggml.token_type") or []
    ids |= {i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in END_OF_TURN_TEXTS}
    return sorted(int(i) for i in ids if i is not None)


def window_on_every_layer(m: GGUFMeta) -> tuple[int, ...]:
    """``{arch}.attention.sliding_window`` on every layer (the llama and phi3 layouts); () for none, 0 or a window
    as long as the context."""
    window = int(m.get("attention.sliding_window", 0))
    layers, context = int(m.require("block_count")), int(m.require("context_length"))
    return (window,) * layers if 0 < window < context else ()


def decoder_config(m: GGUFMeta, architecture: str, family: str, **features) -> ModelConfig:
    """The shared part of a decoder family's config from ``{arch}.*`` metadata; ``features`` sets the fields the
    family decides itself (its windows included: llama.cpp's layout of them differs by architecture)."""
    f = m.f
    hidden, heads = int(m.require("embedding_length")), int(m.require("attention.head_count"))
    head_dim = int(m.get("attention.key_length", hidden // heads))
    if int(m.get("attention.value_length", head_dim)) != head_dim:
        m.refuse("attention.value_length", "values as wide as keys only")
    rotary = int(m.get("rope.dimension_count", head_dim))
    if "token_embd.weight" not in f.tensors:
        raise GGUFError(f"{f.path}: the tensor token_embd.weight is missing")
    kv_heads = m.get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        m.refuse("attention.head_count_kv", "a different number of KV heads per layer")
    fields = dict(
        architecture=architecture, family=family, hidden_size=hidden, num_layers=int(m.require("block_count")),
        num_heads=heads, num_kv_heads=int(kv_heads), head_dim=head_dim,
        intermediate_size=int(m.require("feed_forward_length")),
        vocab_size=int(f.tensors["token_embd.weight"].shape[0]),
        max_position_embeddings=int(m.require("context_length")),
        norm_eps=float(m.require("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in f.tensors, rope_theta=float(m.get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling(m, rotary), rotary_dim=rotary if rotary != head_dim else None,
        qkv_bias="blk.0.attn_q.bias" in f.tensors or "blk.0.attn_qkv.bias" in f.tensors,
        o_bias="blk.0.attn_output.bias" in f.tensors, mlp_bias="blk.0.ffn_down.bias" in f.tensors,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"), eos_token_ids=stop_token_ids(f))
    fields.update(features)
    return ModelConfig(**fields)
