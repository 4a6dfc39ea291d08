"""Sampling parameters of one request, validated at construction.

Field names follow vLLM's ``SamplingParams`` so users and clients feel at home. Every invalid value raises a
``ValueError`` whose message starts with the field's name, so the HTTP layer can report it as ``param``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from conveyor.core.lora_request import LoRARequest
from conveyor.core.pooling_params import PoolingParams

# Bounds that come from where the values end up, not from taste:
FLOAT32_MAX = 3.4028234663852886e38  # sampling runs in float32: a larger float becomes inf there
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's limit)
PRIORITY_MIN, PRIORITY_MAX = -(1 << 31), (1 << 31) - 1  # a signed 32-bit priority; the maximum is the Batch API's
# vLLM's floor: dividing logits by a smaller temperature overflows float32 (inf - inf = NaN in the softmax),
# so a positive temperature below it is raised to it (near-greedy either way).
MIN_TEMPERATURE = 1e-2
# Below this a repetition penalty multiplies logits by more than 100; with a small temperature that overflows
# float32 as well. No sensible use needs less.
MIN_REPETITION_PENALTY = 1e-2


@dataclass(frozen=True)
class ReasoningBlock:
    """A reasoning block the output may write before its constraint applies (``<think>...</think>``, then the
    answer): reasoning models are constrained in their answer, not in their reasoning. Markers are text; a
    marker that is a special token of the vocabulary also gives its id. ``start`` None: the prompt opened the
    block, so the output starts inside it; else the output may open one with ``start`` or answer at once."""

    end: str
    start: str | None = None
    end_token_id: int | None = None
    start_token_id: int | None = None


class RequestOutputKind(enum.IntEnum):
    """What each output of a request holds, as vLLM's ``RequestOutputKind`` (``engine.outputs.RequestOutput``).

    ``CUMULATIVE`` (the default): everything so far, the output processor's own state (valid until its next
    step: copy what you keep; read it on the thread that steps the engine). ``DELTA`` (what streaming handlers
    ask): only what is new since the request's previous output, every output a fresh object; while a completion
    runs its text stops ``max(len(stop)) - 1`` characters short of the end, since a later token may complete a
    stop string there and cut the text (``engine.detokenizer``)."""

    CUMULATIVE = 0
    DELTA = 1


@dataclass
class StructuredOutputsParams:
    """A constraint on the output's text, as vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a JSON
    schema, as a dict or its JSON text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these
    strings) or ``grammar`` (Lark, or GBNF / EBNF as llama.cpp writes it). ``conveyor.structured`` compiles it;
    this class only checks that one kind is given."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    reasoning: ReasoningBlock | None = None  # set by the server for reasoning models: not a kind of its own

    KINDS = ("json", "json_object", "regex", "choice", "grammar")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(self.KINDS)}, "
                             f"got {', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {self.json!r}")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """How to sample the completion(s) of one prompt."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the sampled token's)
    prompt_logprobs: int | None = None  # the same for every prompt token but the first (vLLM's; echo needs it)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (conveyor.structured)
    # KV eviction budget of this request in tokens (core.kv_eviction), under the engine's --kv-eviction policy;
    # None: the engine's --kv-budget-tokens
    kv_budget_tokens: int | None = None
    # Edits of the logits, applied after the raw logprobs are taken, in this order (vLLM's):
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] = field(default_factory=list)  # never end the output with one of these words
    logit_bias: dict[int, float] | None = None  # added to the logits of these token ids, in [-100, 100]
    # bad_words as token sequences (each word with and without a leading space), filled in by the engine's
    # tokenizer (``conveyor.engine.prompts.tokenize_bad_words``) before the request is queued
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # A prefill-only request (embedding, scoring): its prompt's hidden states pooled, no token generated
    # (core.pooling_params); None: a generation request
    pooling: PoolingParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each of its outputs holds
    # The request's place in the queue under --scheduling-policy priority (vLLM's): lower runs first, ties by
    # arrival; the lowest-priority running request is preempted first. Not a sampling choice, but it travels with
    # the request as these do.
    priority: int = 0
    # The LoRA adapter the request runs with (core.lora_request, vLLM's LoRARequest); None: the base model
    lora: LoRARequest | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.bad_words = list(self.bad_words or [])
        if self.logit_bias is not None:
            self.logit_bias = {_token_id_key(k): v for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):  # from JSON or the IPC
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.pooling, dict):  # from the IPC
            self.pooling = PoolingParams(**self.pooling)
        self._validate()
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        def integer(value) -> bool:
            return isinstance(value, int)

        def finite(value) -> bool:  # also refuses NaN, which passes every ``<`` / ``>`` comparison
            return isinstance(value, (int, float)) and math.isfinite(value) and abs(value) <= FLOAT32_MAX

        if not integer(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not finite(self.temperature) or self.temperature < 0.0:
            raise bad("temperature", "must be a finite number in [0, 3.4e38]")
        if not finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not integer(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not finite(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not finite(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not finite(self.repetition_penalty) or self.repetition_penalty < MIN_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"must be a finite number in [{MIN_REPETITION_PENALTY}, 3.4e38]")
        if self.seed is not None and (not integer(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", "must be an integer in [-2**63, 2**64 - 1]")
        if self.max_tokens is not None and (not integer(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not integer(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not integer(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must hold non-empty strings")
        if any(not integer(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must hold non-negative integers")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                not integer(t) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            raise bad("bad_words", "must hold non-empty strings")
        if self.logit_bias is not None and any(
                t < 0 or not finite(b) or not -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
            raise bad("logit_bias", "must map token ids to biases in [-100, 100]")
        if not integer(self.priority) or not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise bad("priority", f"must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}]")
        if self.kv_budget_tokens is not None and (not integer(self.kv_budget_tokens) or self.kv_budget_tokens < 1):
            raise bad("kv_budget_tokens", "must be an integer >= 1")
        if self.structured_outputs is not None and self.ignore_eos:
            raise bad("ignore_eos", "cannot be combined with structured outputs (the grammar decides where the "
                                    "output ends)")
        if self.structured_outputs is not None and self.min_tokens:
            raise bad("min_tokens", "cannot be combined with structured outputs (the grammar decides where the "
                                    "output ends: one that ends sooner would leave no token to sample)")

    def check_vocabulary(self, vocab_size: int) -> None:
        """ValueError naming the field for a token id (``stop_token_ids``, ``allowed_token_ids``, ``logit_bias``'s
        keys) outside the model's vocabulary."""
        check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        check_token_ids("allowed_token_ids", self.allowed_token_ids or (), vocab_size)
        check_token_ids("logit_bias", self.logit_bias or (), vocab_size, "keys ")

    @property
    def greedy(self) -> bool:
        """Greedy decoding: temperature 0 (top-k / top-p then do not matter)."""
        return self.temperature == 0.0

    @property
    def has_logit_edits(self) -> bool:
        """allowed_token_ids, bad_words or logit_bias: the sampler edits this row's logits."""
        return bool(self.allowed_token_ids or self.bad_words_token_ids or self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def for_child(self, index: int) -> SamplingParams:
        """The params of completion ``index`` of an ``n > 1`` request: n=1, and a distinct derived seed."""
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed > SEED_MAX:  # wrap around 2**64, as the generator's own seed space does
            seed -= 1 << 64
        return replace(self, n=1, seed=seed)


def check_token_ids(field: str, ids: Iterable[int], vocab_size: int, what: str = "") -> None:
    """ValueError (starting with ``field``, which the server reports as ``param``) for an id outside
    [0, ``vocab_size``)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{field} {what}must be token ids in [0, {vocab_size}), got {bad}")


def _token_id_key(key) -> int:
    """A logit_bias key: a token id, as an int or (JSON's object keys are strings) its decimal text."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
    try:
        return int(key)
    except ValueError:
        raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
