"""The check a constraint passes before it runs (``structured.checker``): compiled with the engine's limits over
the model's tokenizer and walked a few tokens, in worker processes killed at a time bound. The server-level
reproductions (a 10,000-string choice, a $ref cycle, a 12,000-property schema) are in
tests/server/test_probe_reproductions.py; here, the checker itself: what it refuses and accepts, and that a check
past its bound is refused at the bound and the next check is served by a fresh worker."""

from __future__ import annotations

import time

import pytest

from conveyor.core.sampling_params import StructuredOutputsParams as Spec
from conveyor.structured.checker import GrammarChecker, check_grammar
from conveyor.structured.grammars import error_text
from conveyor.tokenizer import load_tokenizer

MODEL = "conveyor-embedded-llama-40m-random"  # a byte-level vocabulary: any text can be written


def optional_properties(count: int) -> dict:
    return {"type": "object", "properties": {f"p{i:05d}": {"type": "string"} for i in range(count)}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def ll(tokenizer):
    from conveyor.structured.vocabulary import ll_tokenizer

    return ll_tokenizer(tokenizer, tokenizer.vocab_size)


SERVED = [Spec(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
          Spec(json_object=True), Spec(regex="[0-9]{3}-[a-z]+"), Spec(choice=["yes", "no"]),
          Spec(grammar='start: "hi" | "ho"'), Spec(grammar='root ::= "a" | "b" root')]
REFUSED = [(Spec(choice=[f"c{i}" for i in range(10_000)]), "items"),
           (Spec(regex="((a|aa){50}){50}"), "too many expressions"),
           (Spec(grammar='root ::= "a" root'), "Too many items"),
           (Spec(json={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}), "matches no text"),
           (Spec(grammar="root ::= x\nx ::= x"), "matches no text"),
           (Spec(grammar='start: "a" x | "b"\nx: x'), "after its first 1 tokens"),
           (Spec(json={"type": "array", "uniqueItems": True}), "uniqueItems")]


@pytest.mark.parametrize("spec", SERVED, ids=[s.kind for s in SERVED])
def test_what_can_run_passes(ll, tokenizer, spec):
    assert check_grammar(spec, ll, tokenizer.eos_token_id) is None


@pytest.mark.parametrize("spec,why", REFUSED, ids=[w for _, w in REFUSED])
def test_what_cannot_run_is_refused_naming_why(ll, tokenizer, spec, why):
    error = check_grammar(spec, ll, tokenizer.eos_token_id)
    assert error is not None and error.startswith(f"structured_outputs.{spec.kind}: ") and why in error, error
    assert "<non-verbose/>" not in error


def test_a_panic_or_backtrace_never_becomes_the_text():
    panic = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n   0: type_call\n"
             "             at /tmp/python-build/Python-3.11.7/Objects/typeobject.c:1091:11")
    assert error_text(panic) == "the grammar compiler failed on this constraint (it is too large or too complex for it)"
    assert error_text("lexer error: too many expressions constructed\n<non-verbose/>") == \
        "lexer error: too many expressions constructed"


@pytest.mark.slow
def test_a_check_past_its_bound_is_refused_at_the_bound_and_the_next_one_is_served(tokenizer):
    checker = GrammarChecker(tokenizer, tokenizer.vocab_size, timeout_s=0.5, workers=1)
    try:
        checker.check(Spec(choice=["warm", "up"]))  # the worker is up
        started = time.monotonic()
        with pytest.raises(ValueError, match="took longer than 0.5 s"):
            checker.check(Spec(json=optional_properties(6000)))  # about 2 s to compile on a quiet machine
        assert time.monotonic() - started < 5.0  # the bound, not the compile (which the kill cut short)
        checker.check(Spec(regex="[a-z]+"))  # a fresh worker
        with pytest.raises(ValueError, match="matches no text"):
            checker.check(Spec(grammar="root ::= x\nx ::= x"))
        checker.check(Spec(regex="[a-z]+"))  # remembered: no worker needed
    finally:
        checker.close()
