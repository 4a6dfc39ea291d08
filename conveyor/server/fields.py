"""Bounded request field types: what every endpoint's request model declares its numbers and flags with.

A value is checked where it enters, by its type, so that nothing the engine or the engine pipe cannot carry gets
past the request model: the pipe is msgpack (``msgspec``), whose integers stop at -2**63 and 2**64 - 1, and an
integer past that range once killed the API process's sender thread and wedged the server (reliability probe
2026-12-06, N-1). Every type here refuses, with a 400 naming the field (pydantic's error, in OpenAI's shape):

- a bool where a number is wanted, and a number or a string where a bool is wanted (``true`` is not 1,
  ``"yes"`` is not true): OpenAI's own API refuses both, vLLM's coerces them;
- a string where a number is wanted (``"2"`` is not 2), and a float where an integer is wanted (OpenAI: "expected
  an integer, but got a decimal number");
- an integer outside the range the type names, which is never wider than signed 64 bits (``Seed``: the generator's
  unsigned range as well), and a float that is NaN or infinite.

The semantic bounds that depend on the served model or the server's flags (token ids inside the vocabulary,
``n`` under ``--max-n``, prompt + ``max_tokens`` within the context) are checked after parsing, with the served
model's numbers: ``check_token_ids`` (re-exported here), ``ServingContext`` and ``SamplingParams``. New endpoints (other
protocols, other request kinds) declare their fields with these types and inherit the same checks; the fuzz test
(``tests/server/test_fuzz.py``) runs over every route of ``/openapi.json``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, PlainValidator, StrictBool, WithJsonSchema

from conveyor.core.sampling_params import (  # noqa: F401 - check_token_ids: the vocabulary bound, for endpoints
    MAX_LOGPROBS, PRIORITY_MAX, PRIORITY_MIN, SEED_MAX, SEED_MIN, check_token_ids,
)

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# No vocabulary is larger than this (kernels index embeddings with int32); the served model's own vocabulary is
# the exact bound, checked by ``check_token_ids``.
MAX_TOKEN_ID = (1 << 31) - 1


def _int(low: int, high: int) -> Any:
    """An integer in [low, high]: strict (no bool, no string, no float)."""
    return Annotated[int, Field(strict=True, ge=low, le=high)]


Bool = StrictBool
Int64 = _int(INT64_MIN, INT64_MAX)
NonNegativeInt = _int(0, INT64_MAX)
PositiveInt = _int(1, INT64_MAX)
Seed = _int(SEED_MIN, SEED_MAX)  # what torch.Generator.manual_seed takes
TopK = _int(-1, INT64_MAX)  # -1 and 0: off; beyond the vocabulary: the whole vocabulary
TokenId = _int(0, MAX_TOKEN_ID)
LogprobCount = _int(0, MAX_LOGPROBS)
Priority = _int(PRIORITY_MIN, PRIORITY_MAX)  # vLLM's request priority: lower runs first
ServiceTier = Annotated[str, Field(strict=True, min_length=1, max_length=64)]  # a service class's name
# A finite float (ints are taken as floats; bools and strings are not). Ranges are SamplingParams' business.
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]


def _token_id_text(key: str) -> int:
    """A token id written as JSON object keys must be: decimal text ("logit_bias": {"42": 5})."""
    text = key.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not digits.isascii() or not digits.isdigit() or len(digits) > 10:
        raise ValueError(f"must be a token id (an integer in [0, {MAX_TOKEN_ID}]) written as decimal text, "
                         f"got {key[:40]!r}")
    value = int(text)
    if not 0 <= value <= MAX_TOKEN_ID:
        raise ValueError(f"must be a token id in [0, {MAX_TOKEN_ID}], got {value}")
    return value


TokenIdKey = Annotated[str, AfterValidator(_token_id_text)]  # a dict key: the id as text, an int once validated


def _is_token_id(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_TOKEN_ID


_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "string"}},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                            "maximum": MAX_TOKEN_ID}}},
]}


def _prompt(value: Any) -> str | list:
    """A completions prompt: a text, a list of token ids, or a batch (a list of texts or of token-id lists).
    The error says which of these the value failed to be (a union's error would list all four)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"must be a string, a list of token ids, or a list of strings or of token-id lists, "
                         f"got {type(value).__name__}")
    if all(isinstance(v, str) for v in value):
        return value
    if all(type(v) is int for v in value):
        _check_ids(value, "token ids")
        return value
    if all(isinstance(v, list) for v in value):
        for i, ids in enumerate(value):
            if not all(type(t) is int for t in ids):
                raise ValueError(f"prompt {i} must be a list of token ids (integers)")
            _check_ids(ids, f"prompt {i}'s token ids")
        return value
    raise ValueError("must be a string, a list of token ids, or a list of strings or of token-id lists (not a mix)")


def _check_ids(ids: list[int], what: str) -> None:
    bad = next((t for t in ids if not _is_token_id(t)), None)
    if bad is not None:
        raise ValueError(f"{what} must be integers in [0, {MAX_TOKEN_ID}], got {str(bad)[:40]}")


Prompt = Annotated[str | list, PlainValidator(_prompt), WithJsonSchema(_PROMPT_SCHEMA)]
