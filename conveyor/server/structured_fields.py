"""The request fields that ask for constrained output, as clients send them, -> one ``StructuredOutputsParams``.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` and its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. At most one constraint per request;
anything that cannot be enforced is a 400 naming the field (``ValueError`` here, reported by the caller).
"""

from __future__ import annotations

from typing import Any

from conveyor.core.sampling_params import StructuredOutputsParams

GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
# vLLM's structured_outputs options that only tune how a constraint is enforced: conveyor's JSON is compact
# (no free whitespace) and additional properties follow the schema, so these change nothing and are accepted.
TUNING_KEYS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties"}


def structured_outputs_of(body: dict[str, Any]) -> tuple[str, StructuredOutputsParams] | None:
    """The field that asks for a constraint and the constraint (None: unconstrained). ValueError naming the
    field when it is malformed or when more than one constraint is asked for."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    response_format = body.get("response_format")
    if response_format not in (None, {}):
        spec = _response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    so = body.get("structured_outputs")
    if so is not None:
        found.append(("structured_outputs", _structured_outputs(so)))
    for field, kind in GUIDED_ALIASES.items():
        if body.get(field) is not None:
            found.append((field, _make(field, **{kind: body[field]})))
    if len(found) > 1:
        raise ValueError(f"{found[1][0]}: only one constraint per request, and {found[0][0]} is one already")
    return found[0] if found else None


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict) or "type" not in value:
        raise ValueError(f'response_format must be an object with a "type", got {value!r}')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError('response_format.json_schema must be an object with a "schema" object')
        # OpenAI's default for a json_schema without "schema" is any JSON object.
        return _make("response_format.json_schema", json=spec.get("schema") or {"type": "object"})
    raise ValueError(f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}')


def _structured_outputs(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs must be an object, got {value!r}")
    unknown = set(value) - set(StructuredOutputsParams.KINDS) - TUNING_KEYS
    if unknown:
        raise ValueError(f"structured_outputs.{sorted(unknown)[0]} is not supported (supported: "
                         f"{', '.join(StructuredOutputsParams.KINDS)})")
    return _make("structured_outputs", **{k: v for k, v in value.items() if k in StructuredOutputsParams.KINDS})


def _make(field: str, **kinds) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kinds)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(field) else f"{field}: {message}") from None
