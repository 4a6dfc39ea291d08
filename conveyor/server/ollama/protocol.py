"""The Ollama API's request bodies, checked, and their translation to the one internal chat request.

``options`` as Ollama names them: ``num_predict`` (-1 and -2: up to the context), ``temperature``, ``top_k``,
``top_p``, ``min_p``, ``seed``, ``stop``, ``repeat_penalty``, ``presence_penalty``, ``frequency_penalty`` and
``num_ctx`` (checked against the served model's context); the options that only tune how a runner loads or runs
(``num_gpu``, ``num_thread``, ``num_batch``, ``use_mmap``, ``repeat_last_n``, ...) are accepted; the samplers
conveyor does not have (``mirostat``, ``typical_p``, ``tfs_z`` other than their neutral values) are a 400, as is
an option Ollama does not know. ``format`` is ``"json"`` or a JSON schema (structured outputs); ``think`` turns the
chat template's thinking on or off; ``keep_alive`` (seconds, or a duration such as ``5m``) is how long the model
stays loaded once idle (``keep_alive_seconds``).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from conveyor.server.errors import bad_request
from conveyor.server.fields import Bool, Float, Int64, Seed, TokenId, TopK

# The options of a runner's set-up, not of what it generates: accepted, with nothing to do.
RUNNER_OPTIONS = {"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
                  "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "repeat_last_n",
                  "penalize_newline"}
# Samplers conveyor does not have, and the value each takes when off.
NEUTRAL = {"mirostat": 0, "mirostat_tau": None, "mirostat_eta": None, "typical_p": 1.0, "tfs_z": 1.0}


class Options(BaseModel):
    model_config = ConfigDict(extra="allow")

    num_predict: Int64 | None = None
    num_ctx: Annotated[int, Field(strict=True, ge=1, le=1 << 31)] | None = None
    temperature: Annotated[Float, Field(ge=0.0)] | None = None
    top_k: TopK | None = None
    top_p: Float | None = None
    min_p: Float | None = None
    seed: Seed | None = None
    stop: list[str] | None = None
    repeat_penalty: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None

    def checked(self) -> Options:
        for name, value in (self.model_extra or {}).items():
            if name in RUNNER_OPTIONS:
                continue
            if name in NEUTRAL:
                if value not in (None, NEUTRAL[name]) and NEUTRAL[name] is not None:
                    raise bad_request(f"options.{name} is not supported (conveyor has no {name} sampler); leave "
                                      f"it at {NEUTRAL[name]}", f"options.{name}")
                continue
            raise bad_request(f"options.{name} is not an option of the Ollama API", f"options.{name}")
        return self


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str = ""
    images: list[Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _Generation(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    stream: Bool = True
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: str | Float | None = None
    think: Bool | str | None = None

    @field_validator("think")
    @classmethod
    def _effort(cls, value):
        if isinstance(value, str) and value not in ("high", "medium", "low"):
            raise ValueError('must be true, false, "high", "medium" or "low"')
        return value

    @property
    def thinks(self) -> bool | None:
        """Whether the client asked for thinking (None: it did not say; the model's template decides)."""
        return None if self.think is None else self.think is not False


class ChatRequest(_Generation):
    """POST /api/chat."""

    messages: list[OllamaMessage] = []
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generation):
    """POST /api/generate."""

    prompt: str = ""
    system: str | None = None
    template: str | None = None
    suffix: str | None = None
    raw: Bool = False
    context: list[TokenId] | None = None
    images: list[Any] | None = None


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    name: str | None = None  # Ollama's older spelling
    verbose: Bool = False


def _sampling(body: _Generation, max_model_len: int) -> dict:
    options = (body.options or Options()).checked()
    if options.num_ctx is not None and options.num_ctx > max_model_len:
        raise bad_request(f"options.num_ctx is {options.num_ctx}, more than this model's context of {max_model_len} "
                          "tokens (--max-model-len)", "options.num_ctx")
    max_tokens = options.num_predict if options.num_predict is not None and options.num_predict >= 0 else None
    if max_tokens == 0:
        raise bad_request("options.num_predict must be positive, or -1 / -2 for up to the context",
                          "options.num_predict")
    if options.num_predict is not None and options.num_predict < -2:
        raise bad_request(f"options.num_predict must be positive, -1 or -2, got {options.num_predict}",
                          "options.num_predict")
    fields = {"max_tokens": max_tokens, "temperature": options.temperature, "top_k": options.top_k,
              "top_p": options.top_p, "min_p": options.min_p, "seed": options.seed, "stop": options.stop,
              "repetition_penalty": options.repeat_penalty, "presence_penalty": options.presence_penalty,
              "frequency_penalty": options.frequency_penalty}
    fmt = body.format
    if fmt == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad_request(f'format must be "json" or a JSON schema, got {fmt!r}', "format")
    if body.thinks is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinks}
    return fields


def _conversation(messages: list[OllamaMessage]) -> list[dict]:
    """Chat messages: an assistant's ``tool_calls`` get ids, and each ``tool`` message answers the earliest
    unanswered call (of its ``tool_name`` when it names one): Ollama's messages carry no call ids."""
    out, unanswered = [], []
    for i, m in enumerate(messages):
        if m.images:
            raise bad_request(f"messages[{i}]: images are not supported (this server serves text models)",
                              "messages")
        if m.role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role must be system, user, assistant or tool, got {m.role!r}",
                              "messages")
        message: dict = {"role": m.role, "content": m.content}
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(f"messages[{i}].tool_calls[{j}] needs a function with a name", "messages")
                call_id = call.get("id") or f"call_{i}_{j}"
                args = fn.get("arguments", {})
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
                unanswered.append((call_id, fn["name"]))
            message["tool_calls"] = calls
        if m.role == "tool":
            match = next((c for c in unanswered if m.tool_name in (None, c[1])), None)
            if match is None:
                raise bad_request(f"messages[{i}]: a tool result with no tool call before it to answer"
                                  + (f" (tool_name {m.tool_name!r})" if m.tool_name else ""), "messages")
            unanswered.remove(match)
            message["tool_call_id"] = match[0]
        out.append(message)
    return out


def chat_body(body: ChatRequest, model: str, max_model_len: int) -> dict:
    fields = {"model": model, "messages": _conversation(body.messages), "tools": body.tools or None,
              **_sampling(body, max_model_len)}
    return {k: v for k, v in fields.items() if v is not None}


def generate_body(body: GenerateRequest, model: str, max_model_len: int) -> dict:
    """The internal chat request of a generate request: the prompt as the user's message after ``system``
    (``raw`` prompts bypass the template: ``raw_prompt``)."""
    for name in ("suffix", "template"):
        if getattr(body, name):
            raise bad_request(f"{name} is not supported (conveyor renders prompts with the model's own template; "
                              "no fill-in-the-middle)", name)
    if body.images:
        raise bad_request("images are not supported (this server serves text models)", "images")
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
        {"role": "user", "content": body.prompt}]
    fields = {"model": model, "messages": messages, **_sampling(body, max_model_len)}
    return {k: v for k, v in fields.items() if v is not None}


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: str | float | None) -> float | None:
    """Ollama's ``keep_alive`` in seconds: a number of seconds, or a Go duration (``"5m"``, ``"1h30m"``,
    ``"-1"``); negative: stay loaded; None: the server's default. 400 naming ``keep_alive`` for anything else."""
    if value is None or isinstance(value, (int, float)):
        return value
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
    parts = _DURATION_PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise bad_request(f"keep_alive: {value!r} is not a duration (seconds, or e.g. \"5m\", \"1h30m\")",
                          "keep_alive")
    return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
