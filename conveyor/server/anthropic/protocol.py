"""The Anthropic Messages API's request body, checked, and its translation to the one internal chat request.

What is served: ``system`` (a string or text blocks), ``messages`` with text, ``tool_use``, ``tool_result`` and
``thinking`` blocks (a thinking block of an earlier turn is dropped, as Anthropic's API drops it from the prompt),
``tools`` (client tools: ``name``, ``description``, ``input_schema``) and ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``, ``disable_parallel_tool_use``), ``stop_sequences``, ``temperature`` (0 to 1, Anthropic's range),
``top_p``, ``top_k``, ``max_tokens``, ``metadata``, ``thinking`` (``enabled`` turns the chat template's thinking
on; its ``budget_tokens`` is accepted, not enforced) and ``output_config.format`` (a JSON schema, through structured
outputs). Images, documents, server tools (web search, code execution, ...) and unknown block types are a 400.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from conveyor.server.errors import bad_request
from conveyor.server.fields import Bool, Float, NonNegativeInt, PositiveInt, Priority, ServiceTier


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: Bool = False


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: PositiveInt | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: OutputFormat | None = None
    effort: str | None = None


class MessagesRequest(BaseModel):
    """POST /v1/messages (and, without ``max_tokens``, /v1/messages/count_tokens)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: PositiveInt
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: Bool = False
    temperature: Float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: NonNegativeInt | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    priority: Priority = 0  # conveyor's extension (Messages has none): --scheduling-policy priority's order
    # Anthropic's "auto" (may be served by a lower class) or "standard_only" (the default class only), or a class
    service_tier: ServiceTier | None = None

    @property
    def thinks(self) -> bool:
        """Whether the client asked for thinking blocks."""
        return self.thinking is not None and self.thinking.type != "disabled"


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages body without ``max_tokens``."""

    max_tokens: PositiveInt = 1


def _text_of(content: str | list, where: str) -> str:
    """A tool result's or the system prompt's text: a string, or text blocks."""
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{i}]: only text blocks are supported here, got "
                              f"{block.get('type') if isinstance(block, dict) else block!r}", "messages")
        texts.append(block["text"])
    return "".join(texts)


def _conversation(body: MessagesRequest) -> list[dict]:
    """The messages in chat-completions form: text, assistant tool calls, tool results as ``role: tool``."""
    out: list[dict] = []
    if body.system is not None:
        out.append({"role": "system", "content": _text_of([b.model_dump() for b in body.system]
                                                          if isinstance(body.system, list) else body.system,
                                                          "system")})
    called: set[str] = set()
    for i, message in enumerate(body.messages):
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        texts, calls, results = [], [], []
        for j, block in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # an earlier turn's reasoning does not go back into the prompt
            elif kind == "tool_use" and message.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or not isinstance(
                        block.get("input", {}), dict):
                    raise bad_request(f"{where}: a tool_use block needs an id, a name and an input object",
                                      "messages")
                called.add(block["id"])
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
            elif kind == "tool_result" and message.role == "user":
                if block.get("tool_use_id") not in called:
                    raise bad_request(f"{where}: tool_result for tool_use_id {block.get('tool_use_id')!r}, which "
                                      "no earlier assistant message's tool_use block has", "messages")
                text = _text_of(block.get("content", ""), f"{where}.content")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": ("Error: " + text) if block.get("is_error") else text})
            else:
                raise bad_request(f"{where}: content blocks of type {kind!r} are not supported in a "
                                  f"{message.role} message (supported: text, tool_use and thinking from the "
                                  "assistant, tool_result from the user)", "messages")
        out += results
        if texts or calls or not results:
            out.append({"role": message.role, "content": "".join(texts),
                        **({"tool_calls": calls} if calls else {})})
    return out


def _tools(body: MessagesRequest) -> tuple[list[dict] | None, Any, bool | None]:
    """(tools, tool_choice, parallel_tool_calls) in chat-completions form."""
    tools = None
    if body.tools:
        for i, tool in enumerate(body.tools):
            if tool.type not in (None, "custom"):
                raise bad_request(f"tools[{i}]: server tools ({tool.type!r}) are not supported; only client tools "
                                  "(name, description, input_schema)", "tools")
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in body.tools]
    choice = body.tool_choice
    if choice is None:
        return tools, None, None
    if choice.type == "tool" and not choice.name:
        raise bad_request('tool_choice of type "tool" needs the tool\'s name', "tool_choice")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
        "type": "function", "function": {"name": choice.name}}
    if tools is None and choice.type != "none":
        raise bad_request(f"tool_choice {choice.type!r} needs tools", "tool_choice")
    return tools, mapped, False if choice.disable_parallel_tool_use else None


def chat_body(body: MessagesRequest) -> dict:
    """The internal chat request (a ``ChatCompletionRequest``'s fields) of a Messages request."""
    tools, tool_choice, parallel = _tools(body)
    chat: dict = {"model": body.model, "messages": _conversation(body), "max_tokens": body.max_tokens,
                  "stop": body.stop_sequences, "temperature": body.temperature, "top_p": body.top_p,
                  "top_k": body.top_k, "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel,
                  "chat_template_kwargs": {"enable_thinking": body.thinks}, "priority": body.priority,
                  "service_tier": {"standard_only": "default"}.get(body.service_tier, body.service_tier)}
    if body.output_config is not None and body.output_config.format is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    return {k: v for k, v in chat.items() if v is not None}
