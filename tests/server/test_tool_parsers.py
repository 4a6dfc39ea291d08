"""server/tools.py and server/tool_parsers.py without a server: the tool_choice plans, and each tool syntax read
out of a reply as it is generated. Every reply is read twice, whole and one character at a time, and the two
readings must agree (a streamed reply and a whole one go through the same parser)."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from conveyor.server.protocol import ChatMessage
from conveyor.server.reply import ReplyParser, ReplyResult, finish_reason
from conveyor.server.tools import ToolPlan, answered_calls, parser_for_template, plan_tools

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    {"type": "function", "function": {"name": "g"}}]


def read(plan: ToolPlan, text: str, engine_finish: str = "stop", whole: bool = False) -> ReplyResult:
    """``text`` through a fresh parser of ``plan``, one character at a time (or ``whole``)."""
    parser = ReplyParser(None, plan.reply_parser())
    result = ReplyResult(0)
    step = max(1, len(text)) if whole else 1
    for i in range(0, len(text), step):
        result.add(parser.feed(text[i:i + step]))
        if parser.done:
            break
    result.add(parser.finish())
    result.finish_reason = finish_reason(engine_finish, parser, bool(result.tool_calls))
    return result


def calls(result: ReplyResult) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


def both(plan: ToolPlan, text: str, engine_finish: str = "stop") -> ReplyResult:
    whole, streamed = read(plan, text, engine_finish, whole=True), read(plan, text, engine_finish)
    def seen(r: ReplyResult):
        return r.content, [(c.name, c.arguments) for c in r.tool_calls], r.finish_reason

    assert seen(whole) == seen(streamed)
    assert all(c.id.startswith("call_") for c in whole.tool_calls)
    return whole


def test_the_parser_is_read_from_the_template():
    assert parser_for_template("{% if tools %}<tool_call>{{ t }}</tool_call>{% endif %}") == "hermes"
    assert parser_for_template("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert parser_for_template("<|python_tag|>{{ x }}") == "llama3_json"
    assert parser_for_template("<|im_start|>{{ m['role'] }}") == "generic"
    assert parser_for_template(None) == "generic"


def test_hermes_llama3_and_mistral_replies_become_tool_calls():
    hermes = plan_tools(TOOLS, "auto", None, "hermes", None)
    assert hermes.constraint is None and hermes.template_tools == TOOLS
    r = both(hermes, 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 3}}\n</tool_call>\n'
                     '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert r.content == "Sure.\n" and calls(r) == [("f", {"x": 3}), ("g", {})] and r.finish_reason == "tool_calls"
    r = both(hermes, "just text, with a < and <tool but no call")
    assert r.content == "just text, with a < and <tool but no call" and not r.tool_calls and r.finish_reason == "stop"
    llama = plan_tools(TOOLS, "auto", None, "llama3_json", None)
    assert calls(both(llama, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}')) == [("f", {"x": 1})]
    assert calls(both(llama, '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}')) == [
        ("f", {"x": 1}), ("g", {})]
    assert both(llama, "Hello {there}").content == "Hello {there}"
    mistral = plan_tools(TOOLS, "auto", None, "mistral", None)
    assert calls(both(mistral, '[TOOL_CALLS] [{"name": "g", "arguments": {"y": "z"}}]')) == [("g", {"y": "z"})]
    assert calls(both(mistral, '[TOOL_CALLS]f[ARGS]{"x": 5}')) == [("f", {"x": 5})]
    cut = both(mistral, "[TOOL_CALLS] [{broken", engine_finish="length")
    assert (cut.content, cut.tool_calls, cut.finish_reason) == ("", [], "length")  # never the raw syntax as text


def test_a_repeated_call_ends_the_reply_and_one_call_means_one():
    generic = plan_tools(TOOLS, "auto", None, None, "<|im_start|>")
    envelope = '{"tool_calls":[{"name":"f","arguments":{"x":1}},{"name":"f","arguments":{"x":1}},{"name":"f"'
    r = both(generic, envelope, engine_finish="length")
    # the second, identical call ended the reply: one call, a reply that is complete
    assert calls(r) == [("f", {"x": 1})] and r.content == "" and r.finish_reason == "tool_calls"
    r = both(generic, '{"tool_calls":[{"name":"f","arguments":{"x":1}},{"name":"f","arguments":{"x":2}}]}')
    assert calls(r) == [("f", {"x": 1}), ("f", {"x": 2})]  # parallel calls that differ are the model's to make
    one = plan_tools(TOOLS, "auto", False, None, "<|im_start|>")
    assert calls(both(one, '{"tool_calls":[{"name":"f","arguments":{"x":1}},{"name":"g"')) == [("f", {"x": 1})]
    hermes = plan_tools(TOOLS, "auto", None, "hermes", None)
    r = both(hermes, '<tool_call>{"name": "g", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}'
                     '</tool_call><tool_call>{"name": "g"')
    assert calls(r) == [("g", {})] and r.finish_reason == "tool_calls"


def test_a_call_whose_result_the_conversation_holds_is_not_made_again():
    history = [ChatMessage(role="user", content="weather?"),
               ChatMessage(role="assistant", content=None, tool_calls=[
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                   {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}}]),
               ChatMessage(role="tool", tool_call_id="c1", content="sunny")]  # c2 has no result yet
    answered = answered_calls(history)
    assert answered == {("f", '{"x": 1}')}
    generic = dataclasses.replace(plan_tools(TOOLS, "auto", None, None, "<|im_start|>"), answered=answered)
    parser = ReplyParser(None, generic.reply_parser())
    assert not parser.feed('{"tool_calls":[{"name":"f","arguments":{"x": 1}}').tool_calls
    assert parser.done and parser.wants_answer  # its first call: an answer is wanted instead
    assert generic.answer_constraint.json["required"] == ["response"]
    later = ReplyParser(None, generic.reply_parser())
    delta = later.feed('{"tool_calls":[{"name":"f","arguments":{"x":2}},{"name":"f","arguments":{"x":1}}]}')
    assert [c.name for c in delta.tool_calls] == ["f"] and later.done and not later.wants_answer


def test_complete_calls_survive_a_cut_and_the_answer_streams_out_of_its_envelope():
    generic = plan_tools(TOOLS, "auto", None, None, "<|im_start|>")
    r = both(generic, '{"tool_calls":[{"name":"f","arguments":{"x":1}},{"name":"g","argum', engine_finish="length")
    assert calls(r) == [("f", {"x": 1})] and r.content == "" and r.finish_reason == "length"
    r = both(generic, '{"response":"Hi \\"you\\" \\u00e9\\ud83d\\ude00\\n"}')
    assert r.content == 'Hi "you" é😀\n' and r.finish_reason == "stop"
    r = both(generic, '{"response":"It is sun', engine_finish="length")
    assert r.content == "It is sun" and r.finish_reason == "length"
    # streamed, the answer's text comes piece by piece, before the reply is complete
    parser = ReplyParser(None, generic.reply_parser())
    assert parser.feed('{"response":"Hel').content == "Hel" and parser.feed("lo").content == "lo"
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "f"}}, None, None, None)
    cut = both(named, '{"x": 12', engine_finish="length")  # cut: still the call, as it streamed
    assert [(c.name, c.arguments) for c in cut.tool_calls] == [("f", '{"x": 12')] and cut.finish_reason == "length"
    assert both(named, '{"x": 2}').finish_reason == "tool_calls"


def test_required_named_and_generic_constraints_are_the_schemas_of_the_tools():
    required = plan_tools(TOOLS, "required", False, None, None)
    schema = required.constraint.json
    jsonschema.validate([{"name": "f", "arguments": {"x": 1}}], schema)
    for bad in ([], [{"name": "f", "arguments": {}}], [{"name": "h", "arguments": {}}],
                [{"name": "g", "arguments": {}}, {"name": "g", "arguments": {}}]):  # one call: parallel false
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert calls(both(required, '[{"name":"f","arguments":{"x":1}}]')) == [("f", {"x": 1})]
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "f"}}, None, None, None)
    assert named.constraint.json == TOOLS[0]["function"]["parameters"]
    assert calls(both(named, '{"x": 2}')) == [("f", {"x": 2})]
    generic = plan_tools(TOOLS, None, None, None, "<|im_start|>")
    assert generic.mode == "auto" and generic.parser == "generic" and '"f"' in generic.system_message
    jsonschema.validate({"response": "hello"}, generic.constraint.json)
    jsonschema.validate({"tool_calls": [{"name": "g", "arguments": {}}]}, generic.constraint.json)
    assert both(generic, '{"response": "hello"}').content == "hello"


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
