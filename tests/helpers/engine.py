"""Prompts and outputs for engine-level tests."""

from __future__ import annotations

import random


def make_prompts(n: int, seed: int = 0, vocab: int = 384, lo: int = 3, hi: int = 70) -> list[dict]:
    """``n`` token-id prompts of random lengths in [lo, hi], clear of the tiny vocabulary's special ids."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))]} for _ in range(n)]


def token_ids(outputs) -> list[list[int]]:
    """The first completion's token ids of every output."""
    return [o.outputs[0].token_ids for o in outputs]
