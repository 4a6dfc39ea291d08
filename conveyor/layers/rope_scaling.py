"""RoPE inverse frequencies for every scaling checkpoints use, as transformers' ``ROPE_INIT_FUNCTIONS`` compute them
(tests/layers/test_rope_scaling.py compares each), in float64, on the CPU (also while a model is built on the meta device).

``scaling`` is a normalised dict (``models.hf_config.rope_parameters`` builds it from either transformers' format,
``models.gguf_config`` from GGUF metadata): ``{"rope_type": ..., <that type's parameters>}``. Returns
``(inv_freq [rotary_dim // 2], attention_factor)``: the factor multiplies cos and sin (YaRN's and LongRoPE's
"mscale"; 1.0 for the others).

Two types decide by the sequence length in transformers, which a KV cache shared by a batch cannot do per step;
conveyor fixes each once per model, so a request's numbers never depend on what it is batched with:

- ``dynamic`` (NTK): transformers rescales only past ``max_position_embeddings``; conveyor serves up to there, so it
  is the plain RoPE, exactly as transformers computes it within that length.
- ``longrope`` (Phi-3 / Phi-4 long-context): transformers takes ``long_factor`` once a sequence passes
  ``original_max_position_embeddings`` and ``short_factor`` below; conveyor takes ``long_factor`` whenever the model
  serves past the original length (as llama.cpp does for such a context), else ``short_factor``.
- ``freq_factors`` (GGUF ``rope_freqs``: Llama 3's scaling stored as per-frequency divisors).
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "freq_factors")
# The parameters each type reads (rope_type and rope_theta aside): anything else in a checkpoint's rope
# parameters is refused at load (models.hf_config) rather than ignored.
ROPE_KEYS = {
    "default": set(), "linear": {"factor"}, "dynamic": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
    "longrope": {"factor", "original_max_position_embeddings", "attention_factor", "long_factor", "short_factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "freq_factors": {"factors", "attention_factor"},
}


def _base(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, theta: float, scaling: dict | None,
                  max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of a ``dim``-wide rotary part, attention factor). ``max_positions``: the checkpoint's
    ``max_position_embeddings`` (longrope's and yarn's defaults derive from it)."""
    s = scaling or {}
    kind = s.get("rope_type", "default")
    inv = _base(dim, theta)
    if kind in ("default", "dynamic"):
        return inv, 1.0
    if kind == "linear":
        return inv / float(s["factor"]), 1.0
    if kind == "freq_factors":
        return inv / torch.tensor(s["factors"], dtype=torch.float64, device="cpu"), float(s.get("attention_factor") or 1.0)
    if kind == "llama3":
        factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "longrope":
        original = int(s["original_max_position_embeddings"])
        factor = s.get("factor") or max_positions / original
        attention = s.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = s["long_factor"] if max_positions > original else s["short_factor"]
        return inv / torch.tensor(ext, dtype=torch.float64, device="cpu"), float(attention)
    if kind == "yarn":
        original = int(s.get("original_max_position_embeddings") or max_positions)
        factor = s.get("factor") or max_positions / original
        attention = s.get("attention_factor")
        if attention is None:
            mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
            attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                         else _yarn_mscale(factor))
        fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(fast), correction_dim(slow)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return inv / factor * (1 - extrapolation) + inv * extrapolation, float(attention)
    raise ValueError(f"rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
