"""Every endpoint fuzzed (issue 48, item 7), two ways:

1. schemathesis' CLI over every operation of ``/openapi.json`` of ``conveyor serve`` in the default layout (the
   engine core in its own process): the schema's examples, its boundary values (the "coverage" phase: just past
   every ``minimum`` / ``maximum`` the bounded field types declare, wrong types, nulls) and generated requests,
   with the checks of ``tests/helpers/fuzz_checks.py``: no 5xx, no stack trace or path in any answer, strict JSON,
   and a ping (``/health`` and an ordinary completion) every 25 answers and at the end, so a wedge fails the run
   where it happens. Routes added later are fuzzed as soon as they are in the schema.
2. hypothesis over the request models themselves: bodies made of the models' own field names with any JSON values
   (integers past 64 bits, bools, strings, nesting). Whatever a model accepts must become ``SamplingParams`` or a
   ValueError naming a field, and an accepted request must encode for the engine pipe (what wedged the server in
   the probe of 2026-12-06, N-1, could not).

The seed is fixed so that CI is repeatable (``CONVEYOR_FUZZ_SEED`` picks another, "random" a fresh one); the
seed and the number of cases are printed.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from conveyor.engine import ipc
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tests.helpers.load import assert_serving, start_serve, tail

REPO = Path(__file__).resolve().parents[2]
SEED = os.environ.get("CONVEYOR_FUZZ_SEED", "1")
SEED = str(random.randrange(2**32)) if SEED == "random" else SEED
MAX_EXAMPLES = 10  # generated requests per operation, on top of its examples and boundary values


@pytest.mark.slow
def test_schemathesis_over_every_route_finds_no_error_wedge_or_leak(tiny_chat_dir, tmp_path, capsys):
    """A 64-token context: a generated chat request without max_tokens (or with null: vLLM's "no limit", D-9)
    generates 64 tokens, not 512. No queue bound is configured, so the documented 503s cannot occur: any 5xx is a
    defect."""
    served = start_serve(str(tiny_chat_dir), tmp_path / "serve.log", served_model_name="tiny",
                         extra=("--dtype", "float32", "--max-model-len", 64, "--num-kv-blocks", 256,
                                "--grammar-check-timeout", 5))
    try:
        report = tmp_path / "report.json"
        cmd = [sys.executable, "-m", "schemathesis.cli", "run", served.url + "/openapi.json",
               "--checks", "not_a_server_error,no_trace_or_path,strict_json,still_answers",
               "--phases", "examples,coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES), "--seed", SEED,
               "--workers", "1", "--request-timeout", "60", "--suppress-health-check", "all",
               "--generation-database", "none", "--no-color", "--report", "json", "--report-json-path", str(report)]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.helpers.fuzz_checks", "CONVEYOR_FUZZ_URL": served.url,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)  # its cache
        result = json.loads(report.read_text()) if report.exists() else {}
        cases = result.get("test_cases", {})
        with capsys.disabled():
            print(f"\nschemathesis: seed {SEED}, {cases.get('generated')} cases over "
                  f"{result.get('operations', {}).get('tested')} operations, {cases.get('with_failures')} failing")
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:] + tail(served)
        assert result["operations"]["tested"] == result["operations"]["total"] >= 8, result["operations"]
        assert cases["generated"] >= 500 and cases["with_failures"] == 0 and cases["errored"] == 0, cases
        assert result["failures"] == [] and result["errors"] == []
        assert_serving(served, "tiny")
        assert "Traceback" not in served.log(), tail(served, 6000)
        # What the generated cases could not show: no integer of any request body is unbounded (a route added
        # with a plain ``int`` would take 10**30 and hand it to the engine pipe).
        spec = httpx.get(served.url + "/openapi.json", timeout=30).json()
        assert unbounded_integers(spec) == [], "integers without 64-bit bounds (use server/fields.py)"
    finally:
        _, left = served.stop(timeout_s=30)
    assert not left, f"processes outlived conveyor serve: {left}"


def unbounded_integers(spec: dict) -> list[str]:
    """Where an integer of a request body in the OpenAPI document ``spec`` lacks a minimum or a maximum within what
    msgpack carries ([-2**63, 2**64 - 1])."""
    components = spec.get("components", {}).get("schemas", {})
    found: list[str] = []

    def walk(node, where: str, seen: frozenset) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{where}[{i}]", seen)
            return
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            name = ref.rsplit("/", 1)[1]
            if name not in seen:
                walk(components.get(name, {}), name, seen | {name})
            return
        # (FastAPI writes the bounds as floats: 2**64 - 1 becomes 2.0**64, hence the float comparison)
        if node.get("type") == "integer" and not (
                float(-(2**63)) <= node.get("minimum", -(2**70)) and node.get("maximum", 2**70) <= float(2**64 - 1)):
            found.append(where)
        for key, value in node.items():
            if isinstance(value, (dict, list)):
                walk(value, f"{where}.{key}", seen)

    for path, operations in spec.get("paths", {}).items():
        for method, operation in operations.items():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            walk(body.get("schema", {}), f"{method.upper()} {path}", frozenset())
    return found


# ---- the request models, property-based --------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
SPECIAL_INTS = st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30])


def typed_values(schema: dict) -> st.SearchStrategy:
    """Values of the JSON types a field's schema names (``anyOf`` members too), integers near and past every 64-bit
    bound most of all: what a field accepts, and what is just past it."""
    options = []
    for member in schema.get("anyOf", [schema]):
        kind = member.get("type")
        if kind == "integer":
            options += [SPECIAL_INTS, st.integers(-5, 50)]
        elif kind == "number":
            options += [st.floats(-3, 3), SPECIAL_INTS]
        elif kind == "boolean":
            options.append(st.booleans())
        elif kind == "string":
            options.append(st.text(max_size=8))
        elif kind == "array":
            items = member.get("items", {})
            options.append(st.lists(typed_values(items) if items else JSON_VALUES, min_size=1, max_size=3))
        elif kind == "object":
            options.append(st.dictionaries(SPECIAL_INTS.map(str) | st.text(max_size=4),
                                           st.floats(-200, 200) | st.booleans() | JSON_VALUES, max_size=2))
    return st.one_of(*options) if options else JSON_VALUES


def bodies(model, required: dict) -> st.SearchStrategy[dict]:
    """Bodies of ``model``: its required fields filled, then one to three of its other fields, each with a value of
    a type its schema names (mostly) or any JSON value (ints past 64 bits, bools, strings, nesting)."""
    schema = model.model_json_schema()
    props = {name: prop for name, prop in schema["properties"].items() if name not in required}
    per_field = {name: typed_values(prop) | typed_values(prop) | JSON_VALUES for name, prop in props.items()}
    extra = st.lists(st.sampled_from(sorted(props)), min_size=1, max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: per_field[name] for name in names}))
    return st.tuples(st.fixed_dictionaries(required), extra).map(lambda pair: {**pair[1], **pair[0]})


MESSAGES = [{"role": "user", "content": "hi"}]


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=bodies(CompletionRequest, {"prompt": st.just("hi") | st.lists(SPECIAL_INTS, min_size=1, max_size=3)})
       | bodies(ChatCompletionRequest, {"messages": st.just(MESSAGES)}))
def test_whatever_a_request_model_accepts_can_be_sent_to_the_engine(body):
    model = CompletionRequest if "prompt" in body else ChatCompletionRequest
    try:
        request = model.model_validate(body)
    except ValidationError:
        return  # a 400 naming the field (tests/server/test_reliability.py checks the shape)
    try:
        params = request.sampling_params(getattr(request, "max_tokens", None), None)
    except ValueError as exc:
        assert str(exc).split(" ", 1)[0].split(".")[0].rstrip(":") in model.model_fields, exc
        return
    prompt = request.prompt if model is CompletionRequest and isinstance(request.prompt, list) else [1]
    ids = prompt if all(type(t) is int for t in prompt) else [1]
    msgspec.msgpack.encode(ipc.AddRequest(0, "r", ids, params, 0.0))  # raises for anything the pipe cannot carry


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=bodies(TokenizeRequest, {}) | bodies(DetokenizeRequest, {"tokens": st.lists(SPECIAL_INTS, max_size=3)}))
def test_the_tokenizer_routes_take_no_number_past_their_bounds(body):
    model = DetokenizeRequest if "tokens" in body else TokenizeRequest
    try:
        request = model.model_validate(body)
    except ValidationError:
        return
    for token in getattr(request, "tokens", []):
        assert type(token) is int and 0 <= token < 2**31
