"""The OpenAI Responses API's request body, checked, and its translation to the one internal chat request.

Served: ``input`` as a string or items (messages in any role, ``developer`` as ``system``; ``function_call`` and
``function_call_output``; ``reasoning`` items of earlier turns, dropped from the prompt), ``instructions``,
``tools`` (``function`` tools, and ``namespace`` tools: groups of them, whose calls name their namespace),
``tool_choice``, ``parallel_tool_calls``, ``text.format`` (``json_schema``,
``json_object``, ``text``), ``max_output_tokens``, ``temperature``, ``top_p``, ``reasoning.effort`` (``none``
turns the chat template's thinking off), ``previous_response_id`` and ``store``, ``metadata``, ``user``,
``include``, ``truncation`` (accepted). Refused with a 400: other tool types (web search, file search, computer use,
MCP, ...), image and file inputs, ``background``, ``conversation``, ``prompt`` templates, item references.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from conveyor.server.errors import bad_request
from conveyor.server.fields import Bool, Float, PositiveInt


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    max_tool_calls: PositiveInt | None = None
    text: TextConfig | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] | None = None  # OpenAI's ranges
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=0)] | None = None  # logprobs are not served here
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = Field(default=None, max_length=200)
    store: Bool = True
    stream: Bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: Literal[False] | None = None
    conversation: None = None
    prompt: None = None


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or ``input_text`` / ``output_text`` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of text parts", "input")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{i}]: only input_text and output_text parts are supported, got {kind!r}",
                              "input")
        texts.append(part["text"])
    return "".join(texts)


def input_items(body: ResponsesRequest) -> list[dict]:
    """The request's input as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return body.input


def conversation(items: list[dict], earlier: list[dict]) -> list[dict]:
    """``items`` as chat messages, after ``earlier`` ones (a previous response's conversation): consecutive
    function calls form one assistant message with ``tool_calls``; a ``function_call_output`` must answer a call
    made before it."""
    out = list(earlier)
    called = {c["id"] for m in earlier for c in m.get("tool_calls", ())}
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "assistant", "system", "developer"):
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_request(f"{where}: a function_call needs call_id, name and arguments (strings)", "input")
            call = {"id": item["call_id"], "type": "function", "function": {
                "name": joined(item.get("namespace"), item["name"]), "arguments": item["arguments"]}}
            called.add(item["call_id"])
            if out and out[-1]["role"] == "assistant":  # one turn: its text and its calls
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if item.get("call_id") not in called:
                raise bad_request(f"{where}: function_call_output for call_id {item.get('call_id')!r}, which no "
                                  "earlier function_call has", "input")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning does not go back into the prompt
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (supported: message, "
                              "function_call, function_call_output, reasoning)", "input")
    return out


def joined(namespace: str | None, name: str) -> str:
    """A namespaced function's name as the model sees it (``namespace.name``)."""
    return f"{namespace}.{name}" if namespace else name


def split_name(name: str, namespaces: set[str]) -> tuple[str | None, str]:
    """(namespace, name) of a called function: the request's namespaces are the names' prefixes."""
    head, _, tail = name.partition(".")
    return (head, tail) if tail and head in namespaces else (None, name)


def namespaces(body: ResponsesRequest) -> set[str]:
    return {t["name"] for t in body.tools or () if t.get("type") == "namespace" and isinstance(t.get("name"), str)}


def _function(tool: dict, where: str, namespace: str | None = None) -> dict:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise bad_request(f"{where}: only function tools ({{\"type\": \"function\", \"name\", \"parameters\"}}) "
                          f"and namespaces of them are supported, got type {tool.get('type')!r} (hosted tools such "
                          "as web_search run on OpenAI's side, not here)", "tools")
    return {"type": "function", "function": {
        "name": joined(namespace, tool["name"]), "description": tool.get("description") or "",
        "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}}


def _tools(body: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    tools = None
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
                tools += [_function(t, f"tools[{i}].tools[{j}]", tool["name"])
                          for j, t in enumerate(tool.get("tools") or [])]
            else:
                tools.append(_function(tool, f"tools[{i}]"))
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}, '
                              f"got {choice!r}", "tool_choice")
        choice = {"type": "function", "function": {"name": joined(choice.get("namespace"), choice["name"])}}
    return tools, choice


def _response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise bad_request('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                      f'"name", "schema"}}, got {fmt!r}', "text")


def chat_body(body: ResponsesRequest, messages: list[dict]) -> dict:
    """The internal chat request (a ``ChatCompletionRequest``'s fields): ``messages`` is the conversation so far
    (``conversation``), to which the instructions are prepended (they are not carried to a follow-up)."""
    tools, tool_choice = _tools(body)
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    parallel = body.parallel_tool_calls
    if body.max_tool_calls == 1:
        parallel = False
    chat = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": tools, "tool_choice": tool_choice,
            "parallel_tool_calls": parallel, "response_format": _response_format(body.text)}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": body.reasoning.effort != "none"}
    return {k: v for k, v in chat.items() if v is not None}


def output_conversation(content: str, calls: list[tuple[str, str, str]]) -> dict:
    """The assistant message a response adds to its conversation: its text and its calls (id, name, args)."""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, n, a in calls]
    return message
