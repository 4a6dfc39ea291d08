"""``StructuredOutputsParams`` -> llguidance grammar text, checked: ValueError naming what cannot be enforced.

Pure functions of the request, so the API process checks a request (400) before it reaches the engine, and the
engine compiles the same text. No tokenizer is needed for either.
"""

from __future__ import annotations

import dataclasses
import json

from conveyor.core.sampling_params import StructuredOutputsParams

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
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(spec.regex)
        elif kind == "choice":
            text = llguidance.grammar_from("choice", spec.choice)
        else:  # Lark as it is; GBNF / EBNF converted to Lark
            text = llguidance.grammar_from("grammar", spec.grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"structured_outputs.{kind}: {error_text(str(exc))}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, limits=parser_limits())
    if is_error:
        raise ValueError(f"structured_outputs.{kind}: {error_text(messages[0])}")
    return text
