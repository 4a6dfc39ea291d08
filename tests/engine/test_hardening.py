"""Hardening below the HTTP layer: value checks shared by the server and the offline ``LLM``, a request whose
per-request work fails inside a step (it fails alone; the step loop goes on), the queue bound, ``--seed``."""

from __future__ import annotations

import math

import pytest

from conveyor import LLM, SamplingParams
from conveyor.engine.llm_engine import QueueFullError
from tests.helpers.server import make_engine, run_to_completion

SLOW = pytest.mark.slow  # a real (tiny) model and engine: run by CI, skipped by -m "not slow"

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


# ---- one source of truth for value checks -----------------------------------------------------------------
BAD_PARAMS = [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0), ("temperature", 1e39),
    ("top_p", math.nan), ("top_p", 0.0), ("top_p", 1.5), ("min_p", math.nan), ("min_p", -0.1),
    ("presence_penalty", math.nan), ("presence_penalty", 2.5), ("frequency_penalty", -math.inf),
    ("repetition_penalty", math.nan), ("repetition_penalty", math.inf), ("repetition_penalty", 0.0),
    ("repetition_penalty", 0.001), ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.5), ("n", 0),
    ("n", 1.0), ("top_k", -2), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21), ("logprobs", -1),
    ("stop", [""]), ("stop_token_ids", [-1]),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS, ids=[f"{f}={v!r}" for f, v in BAD_PARAMS])
def test_sampling_params_refuse_what_the_sampler_cannot_hold(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(field + " ")  # the server reports it as `param`


def test_sampling_params_accept_the_edges():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)
    children = [SamplingParams(seed=2**64 - 1, n=3).for_child(i).seed for i in range(3)]
    assert children == [2**64 - 1, 0, 1]  # derived seeds wrap around 2**64 instead of overflowing
    assert SamplingParams(temperature=1e-300).temperature == 0.01  # raised to vLLM's floor: no inf logits
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(top_k=-1).top_k == 0
    SamplingParams(temperature=1e30, repetition_penalty=1e30, top_p=1e-300, top_k=2**70)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float64", max_model_len=64, num_kv_blocks=64, debug_invariants=True)


@SLOW
def test_offline_llm_gets_the_request_checks_the_server_gets(llm):
    with pytest.raises(ValueError, match="^min_tokens"):  # a promise that cannot fit in the context
        llm.generate([PROMPT], SamplingParams(min_tokens=60, max_tokens=None), use_tqdm=False)
    with pytest.raises(ValueError, match="^stop_token_ids"):  # would index outside the logits
        llm.generate([PROMPT], SamplingParams(stop_token_ids=[384], min_tokens=1), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate([PROMPT], SamplingParams(min_tokens=59, max_tokens=None, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 59  # exactly the room left: allowed


# ---- a request that fails inside the step fails alone -----------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


@pytest.fixture(scope="module")
def reference(engine):
    engine.add_request("ref", PROMPT, GREEDY)
    return run_to_completion(engine)["ref"].outputs[0].token_ids


@SLOW
def test_a_seed_past_validation_fails_only_its_request(engine, reference):
    bad = SamplingParams(seed=1, max_tokens=6)
    bad.seed = 2**70  # what a missed check would let through: torch.Generator.manual_seed raises on it
    engine.add_request("bad", {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, bad)
    engine.add_request("good", PROMPT, GREEDY)
    finals = run_to_completion(engine)
    assert "sampling generator" in finals["bad"].error and "Overflow" in finals["bad"].error
    assert finals["bad"].outputs[0].finish_reason == "abort" and finals["bad"].finished
    assert finals["good"].error is None and finals["good"].outputs[0].token_ids == reference
    assert engine.kv_manager.usage() == 0.0 and not engine.output_processor.parents
    engine.add_request("after", PROMPT, GREEDY)  # and the engine goes on serving
    assert run_to_completion(engine)["after"].outputs[0].token_ids == reference


@SLOW
def test_a_stop_string_past_validation_fails_every_completion_of_its_request_only(engine, reference):
    engine.add_request("bad", PROMPT, SamplingParams(n=2, max_tokens=6, ignore_eos=True, stop=["x"]))
    engine.add_request("good", PROMPT, GREEDY)
    # bytes in completion 0's stop list: the detokenizer's stop-string search raises TypeError on the first text
    engine.scheduler.requests["0_bad"].sampling_params.stop[0] = b"x"
    finals = run_to_completion(engine)
    assert "detokenize" in finals["bad"].error and "TypeError" in finals["bad"].error
    assert [c.finish_reason for c in finals["bad"].outputs] == ["abort", "abort"]
    assert finals["good"].error is None and finals["good"].outputs[0].token_ids == reference
    assert engine.kv_manager.usage() == 0.0 and not engine.scheduler.requests


@SLOW
def test_stop_token_ids_outside_the_vocabulary_cannot_break_the_sampler(engine):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, min_tokens=3, stop_token_ids=[7])
    engine.add_request("odd", PROMPT, params)
    params.stop_token_ids.append(10**6)  # past validation: the sampler bans only ids it has logits for
    out = run_to_completion(engine)["odd"]
    assert out.error is None and len(out.outputs[0].token_ids) >= 3


# ---- the queue bound counts what waits ------------------------------------------------------------------
@SLOW
def test_queue_bound_counts_only_requests_without_a_free_seat(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=4, max_num_queued_reqs=2)
    assert engine.max_seqs_per_request == 6
    with pytest.raises(ValueError, match="^n is 7"):  # can never be admitted: a client error, not a retry
        engine.add_request("huge", PROMPT, SamplingParams(n=7))
    for i in range(6):  # arriving together, before any step: 4 take the free seats, 2 wait
        engine.add_request(f"r{i}", PROMPT, GREEDY)
    with pytest.raises(QueueFullError):
        engine.add_request("late", PROMPT, GREEDY)
    engine.step()
    assert (engine.scheduler.num_running, engine.scheduler.num_waiting) == (4, 2)
    with pytest.raises(QueueFullError):
        engine.add_request("late", PROMPT, GREEDY)
    run_to_completion(engine)
    engine.add_request("wide", PROMPT, SamplingParams(n=6, max_tokens=2))  # the whole capacity, when idle
    assert len(run_to_completion(engine)["wide"].outputs) == 6


# ---- --seed seeds sampling --------------------------------------------------------------------------------
@SLOW
def test_engine_seed_seeds_sampling_and_a_request_seed_wins(tiny_llama_dir):
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=42)

    def sample(engine_seed: int) -> tuple[list[int], list[int]]:
        engine = make_engine(tiny_llama_dir, seed=engine_seed)  # weights come from the file: only sampling varies
        engine.add_request("free", PROMPT, sampled)
        engine.add_request("pinned", PROMPT, seeded)
        finals = run_to_completion(engine)
        return finals["free"].outputs[0].token_ids, finals["pinned"].outputs[0].token_ids

    free_1, pinned_1 = sample(1)
    free_1_again, pinned_1_again = sample(1)
    free_2, pinned_2 = sample(2)
    assert free_1 == free_1_again and free_1 != free_2
    assert pinned_1 == pinned_1_again == pinned_2
