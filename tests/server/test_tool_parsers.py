"""server/tools.py without a server: the tool_choice plans and the parsers of each family's tool-call syntax."""

from __future__ import annotations

import json

import jsonschema
import pytest

from conveyor.server.tools import ToolPlan, parser_for_template, plan_tools

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    {"type": "function", "function": {"name": "g"}}]


def test_the_parser_is_read_from_the_template():
    assert parser_for_template("{% if tools %}<tool_call>{{ t }}</tool_call>{% endif %}") == "hermes"
    assert parser_for_template("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert parser_for_template("<|python_tag|>{{ x }}") == "llama3_json"
    assert parser_for_template("<|im_start|>{{ m['role'] }}") == "generic"
    assert parser_for_template(None) == "generic"


def test_hermes_llama3_and_mistral_replies_become_tool_calls():
    hermes = plan_tools(TOOLS, "auto", None, "hermes", None)
    assert hermes.constraint is None and hermes.template_tools == TOOLS
    content, calls = hermes.parse('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 3}}\n</tool_call>'
                                  '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 3}), ("g", {})]
    assert hermes.parse("just text") == ("just text", [])
    llama = plan_tools(TOOLS, "auto", None, "llama3_json", None)
    _, calls = llama.parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}')
    assert (calls[0].name, json.loads(calls[0].arguments)) == ("f", {"x": 1})
    mistral = plan_tools(TOOLS, "auto", None, "mistral", None)
    _, calls = mistral.parse('[TOOL_CALLS] [{"name": "g", "arguments": {"y": "z"}}]')
    assert (calls[0].name, json.loads(calls[0].arguments)) == ("g", {"y": "z"})
    assert mistral.parse("[TOOL_CALLS] [{broken") == ("[TOOL_CALLS] [{broken", [])  # cut short: the text


def test_required_named_and_generic_constraints_are_the_schemas_of_the_tools():
    required = plan_tools(TOOLS, "required", False, None, None)
    schema = required.constraint.json
    jsonschema.validate([{"name": "f", "arguments": {"x": 1}}], schema)
    for bad in ([], [{"name": "f", "arguments": {}}], [{"name": "h", "arguments": {}}],
                [{"name": "g", "arguments": {}}, {"name": "g", "arguments": {}}]):  # one call: parallel false
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "f"}}, None, None, None)
    assert named.constraint.json == TOOLS[0]["function"]["parameters"]
    assert [(c.name, c.arguments) for c in named.parse('{"x": 2}')[1]] == [("f", '{"x": 2}')]
    generic = plan_tools(TOOLS, None, None, None, "<|im_start|>")
    assert generic.mode == "auto" and generic.parser == "generic" and '"f"' in generic.system_message
    jsonschema.validate({"response": "hello"}, generic.constraint.json)
    jsonschema.validate({"tool_calls": [{"name": "g", "arguments": {}}]}, generic.constraint.json)
    assert generic.parse('{"response": "hello"}') == ("hello", [])


def test_malformed_tool_requests_are_value_errors_naming_the_field():
    assert plan_tools(TOOLS, "none", None, None, None) is None
    assert plan_tools(None, None, None, None, None) is None
    for tools, choice, words in [([{"type": "function"}], None, "tools[0]"), (None, "required", "tool_choice"),
                                 (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
                                 (TOOLS, "sometimes", "tool_choice")]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[")):
            plan_tools(tools, choice, None, None, None)
    with pytest.raises(ValueError, match="tool_call_parser"):
        plan_tools(TOOLS, "auto", None, "qwen-xml", None)
    assert isinstance(plan_tools(TOOLS, "auto", None, None, None), ToolPlan)
