"""Disaggregated prefill / decode between two engines in one process (``engine.kv_handoff``, no Ray): the
hand-over changes no token, aborts at every stage free both sides' blocks, and nothing leaks under churn."""

from __future__ import annotations

import random

import pytest

from conveyor import SamplingParams
from conveyor.engine.llm_engine import LLMEngine
from tests.helpers.engine import make_prompts
from tests.helpers.server import make_engine, run_to_completion

pytestmark = pytest.mark.slow  # real engines on a real (tiny) checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SHARED = list(range(40, 88))  # 48 tokens: three full blocks of 16, for the prefill side's prefix cache


def single(engine: LLMEngine, prompts, params) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    return {rid: out.outputs[0].token_ids for rid, out in run_to_completion(engine).items()}


def disaggregated(prefill: LLMEngine, decode: LLMEngine, prompts, params, one_at_a_time: bool = False):
    """Every prompt prefilled on ``prefill`` and decoded on ``decode``; returns token ids by request id and how
    many were handed over."""
    finals, handed = {}, 0
    pending = [(str(i), p) for i, p in enumerate(prompts)]

    def drive():
        nonlocal handed
        while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
            for out in prefill.step():
                if out.kv_handoff is not None:
                    assert out.finished and len(out.outputs[0].token_ids) == 1
                    decode.add_handoff(out.kv_handoff)
                    handed += 1
                elif out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids
            for out in decode.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids

    for rid, p in pending:
        prefill.add_prefill_request(rid, p, params)
        if one_at_a_time:
            drive()
    drive()
    return finals, handed


def assert_empty(*engines: LLMEngine) -> None:
    for e in engines:
        assert e.kv_manager.usage() == 0.0, e.kv_manager.usage()
        assert not e.has_unfinished_requests() and not e.handoffs and not e.output_processor.parents
        e.scheduler.check_invariants()


@pytest.mark.parametrize("sides", [
    (dict(), dict()),
    # other block sizes and KV layouts on the two sides: the wire form is per token
    (dict(block_size=16, attention_backend="reference"), dict(block_size=8, attention_backend="cpu")),
    (dict(max_num_batched_tokens=16), dict(block_size=4)),  # chunked prompts on the prefill side
])
def test_greedy_tokens_equal_a_single_engine(tiny_llama_dir, sides):
    prompts = make_prompts(8, seed=3) + [{"prompt_token_ids": SHARED + [100 + i]} for i in range(3)]
    expected = single(make_engine(tiny_llama_dir), prompts, GREEDY)
    prefill, decode = make_engine(tiny_llama_dir, **sides[0]), make_engine(tiny_llama_dir, **sides[1])
    got, handed = disaggregated(prefill, decode, prompts, GREEDY, one_at_a_time=True)
    assert got == expected and handed == len(prompts)
    # the shared head was computed once: the later ones hit the prefill side's cache
    assert prefill.kv_manager.prefix_saved_tokens >= 2 * 48
    assert_empty(prefill, decode)


def test_batched_and_seeded_sampling_continue_exactly(tiny_llama_dir):
    prompts = make_prompts(6, seed=4)
    for params in (GREEDY, SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=12, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3, logprobs=2)):
        expected = single(make_engine(tiny_llama_dir), prompts, params)
        got, _ = disaggregated(make_engine(tiny_llama_dir), make_engine(tiny_llama_dir), prompts, params)
        assert got == expected, params


def test_a_request_that_ends_at_its_first_token_is_not_handed_over(tiny_llama_dir):
    prefill, decode = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir)
    got, handed = disaggregated(prefill, decode, make_prompts(3), SamplingParams(temperature=0.0, max_tokens=1))
    assert handed == 0 and all(len(t) == 1 for t in got.values())
    with pytest.raises(ValueError, match="n > 1"):
        prefill.add_prefill_request("n2", make_prompts(1)[0], SamplingParams(n=2))
    assert_empty(prefill, decode)


def test_an_engine_with_kv_eviction_refuses_the_hand_over(tiny_llama_dir):
    """Eviction cuts a request's block table, so the prompt's K/V is not all there to move (nor at its slots)."""
    evicting = make_engine(tiny_llama_dir, kv_eviction="sink", kv_budget_tokens=64)
    with pytest.raises(ValueError, match="kv-eviction"):
        evicting.add_prefill_request("a", make_prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=4))
    assert not evicting.has_unfinished_requests()


def test_aborts_at_every_stage_free_both_sides(tiny_llama_dir):
    prefill, decode = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir)
    p = make_prompts(4, seed=5)
    # 1. aborted while its prompt is computed (chunked over steps: still prefilling after one)
    chunky = make_engine(tiny_llama_dir, max_num_batched_tokens=8)
    chunky.add_prefill_request("a", {"prompt_token_ids": list(range(5, 60))}, GREEDY)
    chunky.step()
    assert chunky.kv_manager.usage() > 0
    chunky.abort_request("a")
    assert_empty(chunky)
    # 2. exported, then dropped in transit (the decode side never got it): the prefill side already freed it
    prefill.add_prefill_request("b", p[1], GREEDY)
    handoff = next(o.kv_handoff for o in prefill.step() if o.kv_handoff is not None)
    assert handoff.num_bytes > 0
    assert_empty(prefill)
    # 3. delivered but aborted before the decode side admitted it
    decode.add_handoff(handoff)
    assert decode.handoffs.importing
    decode.abort_request("b")
    assert_empty(decode)
    # 4. admitted (KV copied in), aborted mid-decode
    decode.add_handoff(handoff)
    decode.step()
    assert decode.kv_manager.usage() > 0 and not decode.handoffs
    out = decode.abort_request("b")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert_empty(prefill, decode)


def test_no_leak_after_many_requests_with_a_fifth_aborted(tiny_llama_dir):
    """1,000 requests through a small cache on both sides (preemptions on the decode side), about 20% aborted
    at a random point: before, during and after the hand-over. Both sides end with no KV and no request."""
    rng = random.Random(7)
    prefill = make_engine(tiny_llama_dir, num_kv_blocks=48, max_num_batched_tokens=64)
    decode = make_engine(tiny_llama_dir, num_kv_blocks=24, max_model_len=256)
    prompts = make_prompts(900, seed=8, hi=60) + [{"prompt_token_ids": SHARED + [7]}] * 100
    rng.shuffle(prompts)
    doomed = {str(i) for i in range(len(prompts)) if rng.random() < 0.2}
    in_transit, aborted, finished = [], set(), set()
    next_id = 0
    while next_id < len(prompts) or prefill.has_unfinished_requests() or decode.has_unfinished_requests() \
            or in_transit:
        for _ in range(rng.randint(0, 3)):
            if next_id < len(prompts):
                prefill.add_prefill_request(str(next_id), prompts[next_id], SamplingParams(
                    temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True))
                next_id += 1
        for out in prefill.step():
            if out.kv_handoff is not None:
                in_transit.append(out.kv_handoff)
            elif out.finished:
                finished.add(out.request_id)
        for h in in_transit[:rng.randint(0, len(in_transit))]:
            in_transit.remove(h)
            if h.request_id in doomed and rng.random() < 0.3:  # lost in transit
                aborted.add(h.request_id)
            else:
                decode.add_handoff(h)
        for out in decode.step():
            if out.finished:
                finished.add(out.request_id)
        for rid in list(doomed - aborted - finished):
            if rng.random() < 0.2:
                for engine in (prefill, decode):
                    engine.abort_request(rid)
                in_transit = [h for h in in_transit if h.request_id != rid]
                aborted.add(rid)
    assert len(aborted) >= 150 and len(finished | aborted) == len(prompts)
    assert decode.scheduler.num_preemptions > 0  # the small decode cache made it recompute some
    assert_empty(prefill, decode)
    assert prefill.scheduler.make_stats().num_running == decode.scheduler.make_stats().num_waiting == 0


def test_smollm2_greedy_tokens_equal_a_single_engine(smollm2_llm):
    """The real default model (float32), each request alone on both paths (so that the batches, and their
    rounding, are the same); the shared system prompt is a prefix-cache hit on the prefill side after the first."""
    import dataclasses

    from conveyor.engine.chat import render_chat

    base = smollm2_llm.engine
    system = "You are a careful assistant. Answer in one or two short sentences, and never make things up.\n"
    questions = ["What is the capital of France?", "Why is the sky blue?", "Name three red fruits.",
                 "What is 12 times 7?", "Write a haiku about the sea."]
    prompts = [{"prompt_token_ids": render_chat(base.tokenizer, [{"role": "system", "content": system},
                                                                  {"role": "user", "content": q}])}
               for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    expected = {}
    for i, p in enumerate(prompts):
        base.add_request(str(i), p, params)
        expected.update({rid: o.outputs[0].token_ids for rid, o in run_to_completion(base).items()})
    args = dataclasses.replace(base.args, max_model_len=1024, debug_invariants=True)
    prefill = LLMEngine.sharing_model(base, dataclasses.replace(args, block_size=16, num_kv_blocks=64))
    decode = LLMEngine.sharing_model(base, dataclasses.replace(args, block_size=8, num_kv_blocks=128))
    got, handed = disaggregated(prefill, decode, prompts, params, one_at_a_time=True)
    assert got == expected and handed == len(prompts)
    assert all(len(t) > 4 for t in got.values())  # real answers, not an end of turn at once
    assert prefill.kv_manager.prefix_saved_tokens >= (len(prompts) - 1) * 16
    assert_empty(prefill, decode)


@pytest.mark.parametrize("rag_fraction", [0.2, 0.8])  # the long-tail trace, and a prefill-heavy one
def test_trace_requests_equal_a_single_engine_on_the_bench_model(rag_fraction):
    """Requests of the workload generator's long-tail traces (prompts up to about 1,000 tokens) on the bench
    model (bf16), each alone on both paths: the hand-off changes no token."""
    from conveyor.bench.workload_gen import longtail

    trace = longtail(num_requests=16, seed=11, rag_fraction=rag_fraction).requests
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in trace]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    model = dict(model="conveyor-embedded-llama-40m-random", num_kv_blocks=160, max_model_len=2048)
    single_engine = LLMEngine(**model)
    expected = {}
    for i, p in enumerate(prompts):
        single_engine.add_request(str(i), p, params)
        expected.update({rid: o.outputs[0].token_ids for rid, o in run_to_completion(single_engine).items()})
    prefill = LLMEngine.sharing_model(single_engine, single_engine.args)
    decode = LLMEngine.sharing_model(single_engine, single_engine.args)
    got, handed = disaggregated(prefill, decode, prompts, params, one_at_a_time=True)
    assert got == expected and handed == len(prompts)
    assert sum(len(p["prompt_token_ids"]) > 256 for p in prompts) >= (2 if rag_fraction < 0.5 else 8)
    assert_empty(prefill, decode)
