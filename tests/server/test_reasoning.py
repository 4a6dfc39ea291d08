"""server/reasoning.py without a server: which syntax a template writes, where a reply starts, the reasoning split
off the answer (streamed one character at a time and whole, which must agree), and the grammar that constrains only
the answer after the reasoning (checked with llguidance itself, on the embedded model's byte vocabulary)."""

from __future__ import annotations

import llguidance
import pytest

from conveyor.core.sampling_params import ReasoningBlock, StructuredOutputsParams
from conveyor.server.reasoning import SYNTAXES, ReasoningSplitter, reply_start, syntax_for
from conveyor.server.reply import ReplyParser, ReplyResult
from conveyor.server.tools import plan_tools
from conveyor.structured.grammars import closed_objects, grammar_text
from conveyor.structured.vocabulary import ll_tokenizer
from conveyor.tokenizer import ByteTokenizer

THINK, MISTRAL = SYNTAXES["deepseek_r1"], SYNTAXES["mistral"]


def split(start: str, text: str, syntax=THINK, whole: bool = False, drop=(), tools=None) -> ReplyResult:
    parser = ReplyParser(ReasoningSplitter(syntax, start, drop), tools.reply_parser() if tools else None)
    result = ReplyResult(0)
    for i in range(0, len(text), max(1, len(text)) if whole else 1):
        result.add(parser.feed(text[i:i + (len(text) if whole else 1)]))
    result.add(parser.finish())
    return result


def agreed(start: str, text: str, **kw) -> tuple[str, str]:
    whole, streamed = split(start, text, whole=True, **kw), split(start, text, **kw)
    assert (whole.reasoning, whole.content) == (streamed.reasoning, streamed.content)
    return whole.reasoning, whole.content


def test_the_syntax_comes_from_the_flag_or_the_template():
    assert syntax_for(None, "{{ '<think>\\n' }}...{{ '</think>' }}") == THINK
    assert syntax_for(None, "[THINK]{{ m }}[/THINK]") == MISTRAL
    assert syntax_for(None, "<|im_start|>{{ m['content'] }}") is None and syntax_for(None, None) is None
    assert syntax_for("none", "<think></think>") is None and syntax_for("qwen3", None) == THINK
    with pytest.raises(ValueError, match="reasoning_parser"):
        syntax_for("o1", None)


def test_where_a_reply_starts_is_read_from_the_prompt():
    assert reply_start(THINK, "<|Assistant|><think>\n") == "open"  # DeepSeek-R1's template opens the block
    assert reply_start(THINK, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"  # Qwen3, thinking off
    assert reply_start(THINK, "<|im_start|>assistant\n") == "maybe"  # Qwen3, thinking on: the model opens it


def test_reasoning_never_reaches_the_answer_streamed_or_whole():
    assert agreed("open", "\nLet me think.\n</think>\n\nParis.") == ("Let me think.", "Paris.")
    assert agreed("maybe", "<think>\nhmm\n</think>\n\nParis.") == ("hmm", "Paris.")
    assert agreed("maybe", "Paris, no thinking.") == ("", "Paris, no thinking.")
    assert agreed("maybe", "<thin") == ("", "<thin")  # not a marker after all
    assert agreed("closed", "Paris.") == ("", "Paris.")
    assert agreed("open", "still thinking when cut") == ("still thinking when cut", "")  # max_tokens inside it
    assert agreed("open", "a < b </thin and </think>x") == ("a < b </thin and", "x")
    # Mistral's markers, special tokens decoded with the others: those are dropped
    assert agreed("maybe", "[THINK]ok[/THINK]Yes.</s>", syntax=MISTRAL, drop=("</s>", "<s>")) == ("ok", "Yes.")


def test_tool_calls_are_read_in_the_answer_after_the_reasoning():
    generic = plan_tools([{"type": "function", "function": {"name": "f"}}], "auto", None, None, "<|im_start|>")
    r = split("open", 'I should call f: {"tool_calls":[]}</think>{"tool_calls":[{"name":"f","arguments":{}}]}',
              tools=generic)
    assert r.reasoning == 'I should call f: {"tool_calls":[]}' and r.content == ""
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("f", "{}")]


BYTES = ByteTokenizer(512)
VOCAB = ll_tokenizer(BYTES, 512)


def accepts(spec: StructuredOutputsParams, text: str) -> bool:
    matcher = llguidance.LLMatcher(VOCAB, grammar_text(spec), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(BYTES.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_a_constraint_applies_to_the_answer_after_the_reasoning():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    opened = StructuredOutputsParams(json=schema, reasoning=ReasoningBlock(end="</think>"))
    assert accepts(opened, 'hmm, {"a": "x"} maybe </think>\n\n{"a":3}')  # any reasoning, then the schema
    assert not accepts(opened, '{"a":3}')  # the prompt opened the block: it must be closed first
    assert not accepts(opened, 'ok</think>{"a":"no"}')
    optional = StructuredOutputsParams(json=schema, reasoning=ReasoningBlock(end="</think>", start="<think>"))
    assert accepts(optional, '<think>ok</think>{"a":3}') and accepts(optional, '{"a":3}')
    assert not accepts(optional, 'ok</think>{"a":3}')
    choice = StructuredOutputsParams(choice=["yes", "no"], reasoning=ReasoningBlock(end="[/THINK]", start="[THINK]"))
    assert accepts(choice, "[THINK]fine[/THINK] yes") and not accepts(choice, "maybe")
    regex = StructuredOutputsParams(regex="[0-9]{3}", reasoning=ReasoningBlock(end="</think>"))
    assert accepts(regex, "x</think>123") and not accepts(regex, "x</think>12a")


def test_object_schemas_forbid_keys_they_do_not_list_unless_they_say_otherwise():
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    assert accepts(StructuredOutputsParams(json=person), '{"name":"Al"}')
    assert not accepts(StructuredOutputsParams(json=person), '{"name":"Al","country":"FR"}')
    open_person = {**person, "additionalProperties": True}
    assert accepts(StructuredOutputsParams(json=open_person), '{"name":"Al","country":"FR"}')
    nested = {"type": "object", "properties": {"p": person, "tags": {"type": "array", "items": person}},
              "$defs": {"d": person}}
    closed = closed_objects(nested)
    assert closed["additionalProperties"] is False and closed["properties"]["p"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in closed_objects({"type": "object"})  # lists no properties: any object
    merged = {"allOf": [person, {"properties": {"age": {"type": "integer"}}}]}  # closing a member would forbid age
    assert closed_objects(merged) == merged
