"""Structured outputs in the continuous batch (conveyor.structured on llguidance), on the embedded random-weights
model (a byte-level vocabulary: it can write any text, and with random weights only the constraint makes the
output valid, so every check below fails without it).

Every reply validates: JSON schemas (jsonschema), regexes, choices, grammars, greedy and sampled, n = 4, 64
constrained and unconstrained requests in one batch, under chunked prefill and preemption; unconstrained greedy
outputs are token-identical whether or not constrained requests share their batch; what cannot be enforced is a
ValueError naming it; logit_bias / allowed_token_ids / bad_words edit the sampled rows only.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conveyor.core.sampling_params import SamplingParams, StructuredOutputsParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm import LLM
from conveyor.engine.llm_engine import LLMEngine
from conveyor.structured.grammars import grammar_text
from tests.helpers.server import run_to_completion

MODEL = "conveyor-embedded-llama-40m-random"

# The kinds of schemas applications send; strings are bounded so a random model's output ends.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "role": {"enum": ["admin", "user", "guest"]}},
     "required": ["name", "age", "role"], "additionalProperties": False},
    {"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "items": {"type": "array", "maxItems": 2, "items": {
                "type": "object", "properties": {"sku": {"enum": ["a1", "b2"]},
                                                 "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"], "additionalProperties": False}}},
            "required": ["id", "items"], "additionalProperties": False},
        "note": {"type": "string", "maxLength": 4}},
     "required": ["order"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1},
                                      "ok": {"type": "boolean"}, "day": {"type": "string", "format": "date"}},
     "required": ["score", "ok", "day"], "additionalProperties": False},
]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]
GBNF = 'root ::= "(" digit ("," digit)? ("," digit)? ")"\ndigit ::= [0-9]'


@pytest.fixture(scope="module")
def llm():
    return LLM(model=MODEL, dtype="float32", max_model_len=1024, num_kv_blocks=512)


def valid(spec: StructuredOutputsParams, text: str) -> bool:
    if spec.json is not None:
        try:
            jsonschema.validate(json.loads(text), spec.json, format_checker=jsonschema.FormatChecker())
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if spec.json_object:
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if spec.regex is not None:
        return re.fullmatch(spec.regex, text) is not None
    if spec.choice is not None:
        return text in spec.choice
    return re.fullmatch(r"\([0-9](,[0-9]){0,2}\)", text) is not None  # GBNF above


SPECS = [*(StructuredOutputsParams(json=s) for s in SCHEMAS), StructuredOutputsParams(regex=REGEX),
         StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar=GBNF)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_reply_matches_its_constraint_greedy_and_sampled_with_n_4(llm, temperature):
    params = [SamplingParams(n=4, temperature=temperature, seed=7, max_tokens=200, structured_outputs=s)
              for s in SPECS]
    outs = llm.generate([f"prompt {i}:" for i in range(len(SPECS))], params, use_tqdm=False)
    for spec, out in zip(SPECS, outs):
        assert len(out.outputs) == 4
        for c in out.outputs:
            assert c.finish_reason == "stop", (spec, c.text)
            assert valid(spec, c.text), (spec, c.text)


def test_unconstrained_requests_are_unconstrained_and_json_object_gives_an_object(llm):
    free, obj = llm.generate(["plain", "json"], [SamplingParams(temperature=0.0, max_tokens=30),
                                                 SamplingParams(temperature=0.0, max_tokens=300, structured_outputs=
                                                                StructuredOutputsParams(json_object=True))],
                             use_tqdm=False)
    assert not free.outputs[0].text.lstrip().startswith("{")  # random weights: not JSON unless constrained
    if obj.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.outputs[0].text), dict)
    else:  # an unbounded object may run to max_tokens, but what was written is the start of one
        assert obj.outputs[0].text.startswith("{")


def _engine(**overrides) -> LLMEngine:
    args = dict(model=MODEL, dtype="float32", max_model_len=1024, num_kv_blocks=512, debug_invariants=True)
    args.update(overrides)
    return LLMEngine(EngineArgs(**args))


def _run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    return run_to_completion(engine)


def test_64_constrained_and_unconstrained_requests_share_steps_and_plain_greedy_is_unchanged():
    """Half of 64 requests constrained (all kinds), half plain greedy; long prompts under a small token budget
    (chunked prefill) and a KV cache too small for all (preemption). Every constrained reply validates, and
    every plain reply is token-identical to its run without the constrained requests."""
    plain = {f"p{i}": (f"plain request number {i} " * (1 + i % 5), SamplingParams(temperature=0.0, max_tokens=40))
             for i in range(32)}
    constrained = {f"c{i}": (f"constrained {i} " * (1 + i % 7),
                             SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=200,
                                            structured_outputs=SPECS[i % len(SPECS)]))
                   for i in range(32)}
    small = dict(num_kv_blocks=40, block_size=16, max_model_len=512, max_num_batched_tokens=96, max_num_seqs=64)
    alone = _run(_engine(**small), plain)
    engine = _engine(**small)
    mixed = _run(engine, {**plain, **constrained})
    # The cache was too small for all of them: constrained requests were preempted, and resumed with their
    # matcher rebuilt from the tokens they had generated.
    assert sum(mixed[rid].outputs[0].num_preemptions for rid in constrained) > 0
    for rid in plain:
        assert mixed[rid].outputs[0].token_ids == alone[rid].outputs[0].token_ids, rid
    for rid, (_, params) in constrained.items():
        c = mixed[rid].outputs[0]
        assert c.finish_reason == "stop" and valid(params.structured_outputs, c.text), (rid, c.text)


def test_a_constraint_that_cannot_be_enforced_is_a_value_error_naming_it(llm):
    for spec, words in [(StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
                        (StructuredOutputsParams(regex="(?=a)b"), "look-around"),
                        (StructuredOutputsParams(grammar="root ::= ("), "GBNF"),
                        (StructuredOutputsParams(json={"type": "string", "format": "no-such"}), "no-such")]:
        with pytest.raises(ValueError, match=words):
            grammar_text(spec)
        with pytest.raises(ValueError, match=words):
            llm.generate("x", SamplingParams(structured_outputs=spec), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))


def test_a_grammar_is_compiled_once_and_a_failure_to_compile_ends_only_its_request():
    engine = _engine()
    spec = StructuredOutputsParams(choice=CHOICES)
    first = engine.structured.compile(spec)
    assert engine.structured.compile(StructuredOutputsParams(choice=list(CHOICES))) is first  # cached by value
    done = _run(engine, {"bad": ("x", SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(
        json={"type": "array", "uniqueItems": True}))), "good": ("y", SamplingParams(max_tokens=5))})
    assert done["bad"].error is not None and "uniqueItems" in done["bad"].error
    assert done["good"].error is None and len(done["good"].outputs[0].token_ids) == 5


def test_logit_bias_allowed_token_ids_and_bad_words(llm):
    base = SamplingParams(temperature=0.0, max_tokens=12)
    (free,) = llm.generate("edit me", base, use_tqdm=False)
    ids = free.outputs[0].token_ids
    forced = 300 if ids[0] != 300 else 301
    (biased,) = llm.generate("edit me", SamplingParams(temperature=0.0, max_tokens=12, logit_bias={forced: 100}),
                             use_tqdm=False)
    assert set(biased.outputs[0].token_ids) == {forced}
    allowed = [forced, forced + 1]
    (only,) = llm.generate("edit me", SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                                                     allowed_token_ids=allowed), use_tqdm=False)
    assert set(only.outputs[0].token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate("x", SamplingParams(allowed_token_ids=[10 ** 9]), use_tqdm=False)


def test_bad_words_are_never_the_end_of_the_output(tiny_llama_dir):
    """On the tiny word-level model (a word is one token): the greedy output's most frequent word, banned, never
    appears; the other words still may."""
    engine = _engine(model=str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64)
    prompt = "w7 w8 w9"
    free = _run(engine, {"free": (prompt, SamplingParams(temperature=0.0, max_tokens=16))})["free"].outputs[0]
    words = free.text.split()
    word = max(set(words), key=words.count)
    banned = _run(engine, {"banned": (prompt, SamplingParams(temperature=0.0, max_tokens=16, bad_words=[word]))})
    text = banned["banned"].outputs[0].text
    assert word not in text.split() and text != free.text
