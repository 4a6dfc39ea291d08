"""``StructuredOutputsParams`` -> llguidance grammar text, checked: ValueError naming what cannot be enforced.

Pure functions of the request, so the API process checks a request (400) before it reaches the engine, and the
engine compiles the same text. No tokenizer is needed for either.
"""

from __future__ import annotations

import json

from conveyor.core.sampling_params import StructuredOutputsParams

# JSON is generated compact (", " and ": " between items, no newlines): with flexible whitespace a small model
# can spend its whole max_tokens on spaces and newlines inside a valid document.
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = {"type": "object"}


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
        raise ValueError(f"structured_outputs.{kind}: {exc}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        raise ValueError(f"structured_outputs.{kind}: {messages[0]}")
    return text
