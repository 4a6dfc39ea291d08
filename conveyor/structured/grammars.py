"""``StructuredOutputsParams`` -> llguidance grammar text, checked: ValueError naming what cannot be enforced.

Pure functions of the request, so the API process checks a request (400) before it reaches the engine, and the
engine compiles the same text. No tokenizer is needed for either.
"""

from __future__ import annotations

import dataclasses
import json

from conveyor.core.sampling_params import ReasoningBlock, StructuredOutputsParams

# JSON is generated compact (", " and ": " between items, no newlines): with flexible whitespace a small model
# can spend its whole max_tokens on spaces and newlines inside a valid document.
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = {"type": "object"}
# llguidance's resource limits, the same wherever a grammar is compiled (the API process's check, the engine): its
# own defaults (items per Earley row 2,000, items per mask step 50,000, lexer states 250,000, grammar symbols
# 500,000, lexer fuel 1M to build and 200k per step), which bound the work of one mask to milliseconds; and terse
# errors: verbose ones quote parser state and grammar text.
PARSER_LIMITS = {"verbose_errors": False}


def parser_limits():
    """A fresh ``llguidance.LLParserLimits`` with ``PARSER_LIMITS``."""
    import llguidance

    return llguidance.LLParserLimits(**PARSER_LIMITS)


def error_text(message: str) -> str:
    """What of an llguidance error a client may read: the message without the ``<non-verbose/>`` marker (a regex
    error keeps its lines: they point at the offending part), at most 1,000 characters; a Rust panic, which comes
    with a native backtrace and the build machine's file paths, as one plain sentence."""
    if message.lstrip().startswith("panic") or "<backtrace>" in message or "stack backtrace" in message:
        return "the grammar compiler failed on this constraint (it is too large or too complex for it)"
    text = message.replace("<non-verbose/>", "").strip()
    return text[:1000] or "unknown error"


def spec_key(spec: StructuredOutputsParams) -> str:
    """One text per constraint, whatever the order of a schema's keys."""
    return json.dumps(dataclasses.asdict(spec), sort_keys=True, separators=(",", ":"))


# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE_SCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema):
    """``schema`` with every object schema that lists ``properties`` closed to other keys
    (``additionalProperties: false``) unless it says what other keys may hold, as vLLM's default backend
    (xgrammar, ``strict_mode``) compiles schemas. Clients' tool and output schemas (LangChain's ``@tool``,
    instructor, LlamaIndex) seldom say it, and a small model otherwise invents keys until ``max_tokens``.

    Left open: an object schema that lists no properties (``{"type": "object"}`` is any object), and the
    members of an ``allOf`` and an object beside one (closing either would forbid the keys the other adds)."""
    return _close(schema, in_all_of=False)


def _close(node, in_all_of: bool):
    if isinstance(node, list):
        return [_close(item, in_all_of=False) for item in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _ONE_SCHEMA:
        if isinstance(out.get(key), (dict, list)):
            out[key] = _close(out[key], in_all_of=False)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(s, in_all_of=False) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s, in_all_of=False) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(s, in_all_of=True) for s in out["allOf"]]
    lists_properties = isinstance(out.get("properties"), dict)
    if lists_properties and not in_all_of and "allOf" not in out and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``spec``; ValueError ("structured_outputs.<kind>: why") when it is invalid or uses
    a feature llguidance cannot enforce (e.g. a JSON schema's ``uniqueItems``, a regex look-ahead)."""
    import llguidance

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema = ANY_JSON_OBJECT if kind == "json_object" else spec.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            schema = closed_objects(schema)
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(spec.regex)
        elif kind == "choice":
            text = llguidance.grammar_from("choice", spec.choice)
        else:  # Lark as it is; GBNF / EBNF converted to Lark
            text = llguidance.grammar_from("grammar", spec.grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"structured_outputs.{kind}: {error_text(str(exc))}") from None
    if spec.reasoning is not None:
        text = after_reasoning(text, spec.reasoning)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, limits=parser_limits())
    if is_error:
        raise ValueError(f"structured_outputs.{kind}: {error_text(messages[0])}")
    return text


def after_reasoning(grammar: str, block: ReasoningBlock) -> str:
    """``grammar`` (llguidance's JSON form or Lark text) applied after a reasoning block: the block's body is free
    text up to its end marker (a lazy lexeme, so the first end marker closes it; a marker that is one token is
    named by id, since llguidance reads added tokens as special), a little whitespace may follow, then the
    constrained answer (llguidance's own recipe for reasoning models, docs/syntax.md)."""
    if grammar.lstrip().startswith("{"):
        inner = json.loads(grammar)["grammars"]
    else:
        inner = [{"lark_grammar": grammar}]
    inner[0] = {**inner[0], "name": "answer"}
    if block.end_token_id is not None:  # a special token: the body is any text, the token ends it
        body = f"think: /(?s:.*)/ <[{block.end_token_id}]>"
    else:
        body = "think[lazy]: /(?s:.*)" + _regex_literal(block.end) + "/"
    if block.start is None:
        start = "start: think ws? @answer"
    else:
        opening = f"<[{block.start_token_id}]>" if block.start_token_id is not None else json.dumps(block.start)
        start = f"start: (ws? {opening} think ws?)? @answer"
    # a few newlines around the block (Qwen3 writes two after it); unbounded, a small model may write only those
    lark = "\n".join([start, body, "ws: /[ \\t\\r\\n]{1,8}/"])
    return json.dumps({"grammars": [{"lark_grammar": lark}, *inner]})


_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _regex_literal(text: str) -> str:
    """``text`` as a literal inside a Lark ``/.../`` regex (Rust regex syntax, ``/`` escaped)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)
