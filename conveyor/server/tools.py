"""Tool calling on /v1/chat/completions: ``tools`` + ``tool_choice`` -> what the reply is constrained to, what the
chat template is given, and how the generated text becomes OpenAI ``tool_calls``.

- ``tool_choice`` "none": the tools are ignored (as vLLM does by default, they are not shown to the model).
- a named function: the reply is that function's arguments, constrained by its ``parameters`` schema.
- "required": the reply is a JSON array of one or more ``{"name", "arguments"}`` calls (one when
  ``parallel_tool_calls`` is false), each constrained by its tool's schema. Both work with any model.
- "auto": a parser of the model family's own tool syntax when its chat template has one (``hermes``:
  ``<tool_call>{...}</tool_call>`` as Qwen2.5 and many fine-tunes; ``llama3_json``: a bare JSON object, Llama 3.x;
  ``mistral``: ``[TOOL_CALLS][...]``), picked by ``--tool-call-parser`` or from the template; for a template with
  no tool syntax (the default model's), the ``generic`` format llama.cpp's server uses: the tools are described
  in a system message and the reply is constrained to ``{"tool_calls": [...]}`` or ``{"response": "..."}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from conveyor.core.sampling_params import StructuredOutputsParams
from conveyor.server.tool_parsers import ToolParser, call_key, make_parser

PARSERS = ("hermes", "llama3_json", "mistral", "generic")


@dataclass
class ToolPlan:
    """How one request uses its tools: ``constraint`` (None: unconstrained), the tools the chat template sees,
    a system message to prepend (generic format) and the syntax the reply is read in (``tool_parsers``)."""

    mode: str  # "named" | "required" | "auto"
    parser: str  # one of PARSERS, or "named" / "required"
    tools: list[dict]
    constraint: StructuredOutputsParams | None = None
    template_tools: list[dict] | None = None
    system_message: str | None = None
    named: str | None = None
    one_call: bool = False  # parallel_tool_calls: false
    answered: frozenset = frozenset()  # call_key of the calls whose results the conversation holds
    answer_constraint: StructuredOutputsParams | None = None  # generic: a reply that is an answer, no call

    def reply_parser(self) -> ToolParser:
        """A parser for one reply (one per choice)."""
        return make_parser(self.parser, self.one_call, self.named, self.answered)


def parser_for_template(template: str | None) -> str:
    """The tool syntax a chat template writes, from the markers it contains; ``generic`` when it has none."""
    template = template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "generic"


def plan_tools(tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               parser: str | None, template: str | None) -> ToolPlan | None:
    """The plan for a request's tools (None: no tool use). ValueError naming the field when malformed."""
    tools = _checked_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools")
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    one_call = parallel_tool_calls is False
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if name not in by_name:
            raise ValueError(f"tool_choice names no tool of this request: {tool_choice!r}")
        return ToolPlan("named", "named", tools, StructuredOutputsParams(json=_parameters(by_name[name])),
                        named=name, one_call=True)
    if tool_choice == "required":
        return ToolPlan("required", "required", tools,
                        StructuredOutputsParams(json=_calls_schema(by_name, one_call)), one_call=one_call)
    if tool_choice != "auto":
        raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, got {tool_choice!r}')
    parser = parser or parser_for_template(template)
    if parser not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    if parser != "generic":
        return ToolPlan("auto", parser, tools, template_tools=tools, one_call=one_call)
    answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
              "additionalProperties": False}
    schema = {"anyOf": [
        {"type": "object", "properties": {"tool_calls": _calls_schema(by_name, one_call)},
         "required": ["tool_calls"], "additionalProperties": False},
        answer,
    ]}
    return ToolPlan("auto", "generic", tools, StructuredOutputsParams(json=schema),
                    system_message=_generic_system_message(tools), one_call=one_call,
                    answer_constraint=StructuredOutputsParams(json=answer))


def _checked_tools(tools: list[dict] | None) -> list[dict]:
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(
                fn.get("name"), str) or not fn["name"]:
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                             f'"parameters": ...}}}}, got {tool!r}')
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema (an object)")
    return list(tools or [])


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def _calls_schema(by_name: dict[str, dict], one_call: bool) -> dict:
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": _parameters(fn)},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for name, fn in by_name.items()]}
    return {"type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if one_call else {})}


def _generic_system_message(tools: list[dict]) -> str:
    described = json.dumps([t["function"] for t in tools], ensure_ascii=False, indent=2)
    return ("You can call these tools:\n" + described + "\n\nReply in JSON, either with the tool calls you "
            'need, as {"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}, or with '
            'your answer to the user, as {"response": <text>}.')


def messages_for_tools(messages: list[dict], plan: ToolPlan | None, raw: list) -> list[dict]:
    """The conversation the template renders: assistant ``tool_calls`` and ``tool`` results kept (for templates
    with tool syntax), written as text the generic format reads when the template has none. ``raw``: the request's
    ``ChatMessage`` models, whose ``tool_calls`` the request model has validated."""
    out = []
    for m, original in zip(messages, raw):
        calls = [c.model_dump(exclude_none=True) for c in original.tool_calls or ()]  # validated: protocol.py
        if plan is not None and plan.parser == "generic" and m["role"] == "assistant" and calls:
            body = {"tool_calls": [{"name": c["function"]["name"],
                                    "arguments": _as_object(c["function"].get("arguments"))} for c in calls]}
            m = {**m, "content": json.dumps(body, ensure_ascii=False)}
        elif calls:
            m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                        "arguments": _as_object(c["function"].get("arguments"))}}
                                     for c in calls]}
        if m["role"] == "tool" and original.tool_call_id:
            m = {**m, "tool_call_id": original.tool_call_id}
        out.append(m)
    if plan is not None and plan.system_message:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + plan.system_message}
        else:
            out.insert(0, {"role": "system", "content": plan.system_message})
    return out


def answered_calls(messages: list) -> frozenset:
    """The ``call_key`` of every assistant tool call in ``messages`` (``ChatMessage``s) that a later ``tool``
    message answers (by ``tool_call_id``)."""
    made: dict[str, tuple[str, str]] = {}
    answered = set()
    for m in messages:
        for call in m.tool_calls or ():
            made[call.id] = call_key(call.function.name, call.function.arguments or {})
        if m.role == "tool" and m.tool_call_id in made:
            answered.add(made[m.tool_call_id])
    return frozenset(answered)


def _as_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
