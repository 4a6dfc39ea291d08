"""Request bodies of the OpenAI-compatible API (and vLLM's extras), as pydantic models.

Unknown fields are ignored, as vLLM does, so clients that send newer OpenAI fields keep working (``user``,
``metadata``, ``store``, ``service_tier``, ...), except the fields in ``REFUSED_FIELDS``: features conveyor does not
implement, which a client sends expecting them to change the answer. Numbers and flags are declared with the
bounded types of ``server.fields`` (no bool taken as a number, nothing past what the engine pipe carries); the
value checks that need no served model live in ``SamplingParams`` (one source of truth, shared with the offline
``LLM``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from conveyor.core.sampling_params import SamplingParams
from conveyor.server.fields import (
    Bool, Float, LogprobCount, NonNegativeInt, PositiveInt, Priority, Prompt, Seed, ServiceTier, TokenId, TokenIdKey,
    TopK,
)
from conveyor.server.structured_fields import GUIDED_ALIASES, structured_outputs_of


@dataclass(frozen=True)
class Refused:
    """A request field conveyor does not implement: 400 "<name> is not supported" (``param``: the name) unless it
    is absent or holds one of ``accepts``, the values that ask for nothing (clients that fill in every default
    send them). ``endpoint``: "completions" or "chat" when only that endpoint refuses it."""

    name: str  # dotted for a nested field
    accepts: tuple = (None,)
    endpoint: str | None = None
    note: str = ""  # what is served instead, for the message

    @property
    def message(self) -> str:
        return f"{self.name} is not supported" + (f" ({self.note})" if self.note else "")


# Each of these, ignored, would answer 200 with something other than what the client asked for, and the client
# could not tell. Harmless unknown fields stay ignored.
REFUSED_FIELDS: tuple[Refused, ...] = (
    # Constrained decoding (vLLM's guided_* and structured_outputs, OpenAI's response_format): ignored, the
    # client gets unconstrained text that it will parse as JSON, a regex match or one of its choices.
    # (response_format, structured_outputs and guided_json / regex / choice / grammar are served:
    # server/structured_fields.py). What is left would be ignored: a whitespace pattern, vLLM's structural tags.
    Refused("guided_whitespace_pattern"), Refused("structural_tag"),
    # Custom logits processors (vLLM loads them by name): none are served.
    Refused("logits_processors", (None, [])), Refused("vllm_xargs", (None, {})),
    # Stopping on repeated patterns (vLLM): ignored, a looping generation runs to max_tokens.
    *(Refused(name, (None, 0)) for name in ("max_repetition_pattern_size", "min_repetition_pattern_size",
                                            "repetition_min_count")),
    # Another input than the prompt as given: truncation (even a nonsense value such as -5: the client meant
    # something) would change what the model sees and the usage; embeddings replace the tokens; a suffix asks
    # for fill-in-the-middle.
    Refused("truncate_prompt_tokens"), Refused("prompt_embeds"), Refused("suffix", (None, "")),
    # What the chat template would be given: another template, RAG documents. Ignored, the model sees another
    # prompt than the one asked for. (chat_template_kwargs is served: its variables go to the template.)
    Refused("chat_template", endpoint="chat"), Refused("documents", (None, []), "chat"),
    # Served on /v1/completions only.
    Refused("prompt_logprobs", endpoint="chat"),
    # OpenAI's deprecated function calling (tools and tool_choice are served: server/tools.py).
    Refused("functions", (None, []), "chat"), Refused("function_call", (None, "none"), "chat"),
    # Decoding that is not sampling.
    Refused("use_beam_search", (None, False)),
    # Parts of the answer conveyor does not produce: the client would read fields that are not there, or tokens
    # in another form than it asked for.
    Refused("return_tokens_as_token_ids", (None, False)), Refused("return_token_ids", (None, False)),
    Refused("spaces_between_special_tokens", (None, True)),
    Refused("audio", endpoint="chat"), Refused("modalities", (None, ["text"]), "chat"),
    Refused("web_search_options", endpoint="chat"),
    # Cache requests: a salted prefix cache (an isolation promise between tenants: ignoring it would be a silent
    # security downgrade), KV transfer between engines. (priority is served: core/policies/priority.py.)
    Refused("cache_salt"), Refused("kv_transfer_params", (None, {})),
)

_LAX_BOOLS = {"0": False, "off": False, "f": False, "false": False, "n": False, "no": False,
              "1": True, "on": True, "t": True, "true": True, "y": True, "yes": True}  # what pydantic coerces


def refused_field(data: dict, endpoint: str) -> Refused | None:
    """The first field of a request body (the parsed JSON) that ``REFUSED_FIELDS`` refuses on ``endpoint``."""
    for field in REFUSED_FIELDS:
        if field.endpoint not in (None, endpoint):
            continue
        value: Any = data
        for part in field.name.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        flag = any(isinstance(ok, (bool, int)) for ok in field.accepts)
        if flag and isinstance(value, str) and value.strip().lower() in _LAX_BOOLS:
            value = _LAX_BOOLS[value.strip().lower()]
        if value not in field.accepts:  # == as in JSON: 0 asks for what false does
            return field
    return None


class StreamOptions(BaseModel):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions: OpenAI's, then the extras vLLM accepts."""

    model_config = ConfigDict(extra="ignore")
    endpoint: ClassVar[str] = ""  # "completions" / "chat": which entries of REFUSED_FIELDS apply
    _refused: Refused | None = PrivateAttr(default=None)
    _constraint_field: str | None = PrivateAttr(default=None)  # the field that asked for structured output

    model: str | None = None
    n: PositiveInt = 1
    temperature: Float | None = None
    top_p: Float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[TokenIdKey, Float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's constrained decoding, and its older spellings
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: llguidance enforces every constraint
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    # vLLM extras
    top_k: TopK | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: NonNegativeInt = 0
    ignore_eos: Bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    # conveyor's own: the request's KV budget under --kv-eviction (core.kv_eviction)
    kv_budget_tokens: PositiveInt | None = None
    # vLLM's: the request's place in the queue under --scheduling-policy priority (lower first, ties by arrival)
    priority: Priority = 0
    # OpenAI's: which service class serves it (server/admission.py: auto, default, or a --service-class name)
    service_tier: ServiceTier | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's ``SamplingParams``; raises ValueError (message starts with the field name) when bad."""
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        constraint = structured_outputs_of(self.model_dump(include={
            "response_format", "structured_outputs", *GUIDED_ALIASES}))
        self._constraint_field = constraint[0] if constraint else None
        return SamplingParams(
            structured_outputs=constraint[1] if constraint else None, allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []), logit_bias=self.logit_bias or None,
            n=self.n, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, kv_budget_tokens=self.kv_budget_tokens,
            priority=self.priority,
            **{k: v for k, v in given.items() if v is not None},
        )

    @property
    def constraint_field(self) -> str | None:
        """The field that asked for the request's structured output (set by ``sampling_params``)."""
        return self._constraint_field

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def refused(self) -> Refused | None:
        """The first field of the body that this server refuses rather than ignores (``REFUSED_FIELDS``)."""
        return self._refused

    @model_validator(mode="wrap")
    @classmethod
    def _find_refused(cls, data, handler):
        # The raw body: most refused fields are not declared, and pydantic drops undeclared fields.
        body = handler(data)
        if isinstance(data, dict):
            body._refused = refused_field(data, cls.endpoint)
        return body


class CompletionRequest(SamplingFields):
    """POST /v1/completions. ``prompt``: text, token ids, or a batch of either."""

    endpoint: ClassVar[str] = "completions"
    prompt: Prompt
    max_tokens: NonNegativeInt | None = 16  # 0 only with echo (score the prompt)
    logprobs: LogprobCount | None = None
    echo: Bool = False  # the prompt (and, with logprobs, its tokens' logprobs) before the completion
    prompt_logprobs: LogprobCount | None = None  # vLLM's: top logprobs of every prompt token, per choice
    best_of: PositiveInt | None = None
    suffix: str | None = None
    add_special_tokens: Bool = True


class FunctionCall(BaseModel):
    """The function of an assistant message's tool call: its name, and its arguments as JSON text (OpenAI's
    form) or an object (what some clients send)."""

    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallEntry(BaseModel):
    """One of an assistant message's ``tool_calls`` (OpenAI's ``{"id", "type": "function", "function"}``)."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A chat message; a malformed tool history (a call without ``function``, a function that is a string or has
    no ``name``) is a 400 naming the message and the field (``messages.1.tool_calls.0.function``)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallEntry] | None = None
    tool_call_id: str | None = None


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming a function: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    endpoint: ClassVar[str] = "chat"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: Bool = False
    top_logprobs: LogprobCount | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False  # vLLM's: the final message left open, for the model to continue
    echo: Bool = False  # vLLM's: the reply starts with the final message's text when it is in the reply's role
    add_special_tokens: Bool = False  # the chat template already writes BOS where the model wants it
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template (enable_thinking)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): either ``prompt`` or ``messages``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    return_token_strs: Bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]
