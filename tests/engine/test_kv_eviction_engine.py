"""KV eviction on a real engine (a tiny random Llama): ``none`` is the default path exactly; with a budget a
request finishes within budget + one block of KV; scoring changes no output; backends agree under eviction."""

from __future__ import annotations

import pytest

from conveyor import LLM, SamplingParams
from tests.helpers.engine import make_prompts, token_ids

pytestmark = pytest.mark.slow  # a real model and engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)


def make_llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), dtype=kw.pop("dtype", "float32"), debug_invariants=True, **kw)


def logprobs_of(outs):
    return [[(lp.token_id, lp.logprob, lp.top) for lp in o.outputs[0].logprobs] for o in outs]


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(6, lo=20, hi=90)


def test_none_is_the_default_path_bit_for_bit(tiny_llama_dir, prompts):
    default = make_llm(tiny_llama_dir, block_size=8, max_num_batched_tokens=32)
    none = make_llm(tiny_llama_dir, block_size=8, max_num_batched_tokens=32, kv_eviction="none")
    a, b = default.generate(prompts, GREEDY, use_tqdm=False), none.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(a) == token_ids(b)
    assert logprobs_of(a) == logprobs_of(b)  # exact floats, not close
    assert none.engine.scheduler.evictor is None


@pytest.mark.parametrize("policy", ["sink", "h2o", "snapkv"])
def test_a_budget_larger_than_the_request_changes_nothing(tiny_llama_dir, prompts, policy):
    # the policy runs (h2o and snapkv score every step / the prompt's window) but never needs to evict
    exact = make_llm(tiny_llama_dir, block_size=8, max_num_batched_tokens=32, dtype="float64",
                     attention_backend="reference")
    big = make_llm(tiny_llama_dir, block_size=8, max_num_batched_tokens=32, dtype="float64",
                   attention_backend="reference", kv_eviction=policy, kv_budget_tokens=1024)
    assert token_ids(big.generate(prompts, GREEDY, use_tqdm=False)) == \
        token_ids(exact.generate(prompts, GREEDY, use_tqdm=False))
    assert big.engine.kv_manager.num_evicted_blocks == 0


@pytest.mark.parametrize("policy", ["sink", "h2o"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_with_a_budget_requests_finish_within_budget_plus_a_block(tiny_llama_dir, prompts, policy, backend):
    budget, block = 32, 8
    llm = make_llm(tiny_llama_dir, block_size=block, max_num_batched_tokens=64, kv_eviction=policy,
                   kv_budget_tokens=budget, attention_backend=backend, enable_prefix_caching=False)
    kv = llm.engine.kv_manager
    most = []
    llm.engine.step_listeners.append(lambda rec: most.append(max((len(b) for b in kv.req_blocks.values()),
                                                                 default=0)))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert max(most) * block <= budget + block
    assert kv.num_evicted_blocks > 0
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_snapkv_keeps_the_prompt_within_budget_then_generates(tiny_llama_dir, prompts):
    llm = make_llm(tiny_llama_dir, block_size=8, max_num_batched_tokens=128, kv_eviction="snapkv",
                   kv_budget_tokens=32, attention_backend="reference", enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert llm.engine.kv_manager.num_evicted_blocks > 0


@pytest.mark.parametrize("policy", ["sink", "h2o"])
def test_backends_agree_under_eviction(tiny_llama_dir, prompts, policy):
    # the same evicted tables read through different kernels give the same greedy tokens (float64: no near-ties)
    runs = []
    for backend in ("reference", "cpu-torch"):
        llm = make_llm(tiny_llama_dir, block_size=4, max_num_batched_tokens=16, dtype="float64",
                       attention_backend=backend, kv_eviction=policy, kv_budget_tokens=24)
        runs.append(token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)))
    assert runs[0] == runs[1]
    exact = make_llm(tiny_llama_dir, block_size=4, max_num_batched_tokens=16, dtype="float64",
                     attention_backend="reference")
    assert runs[0] != token_ids(exact.generate(prompts, GREEDY, use_tqdm=False))  # eviction did change the context


def test_per_request_budget_and_its_refusal(tiny_llama_dir, prompts):
    llm = make_llm(tiny_llama_dir, block_size=8, kv_eviction="sink")  # no engine budget: per request only
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, kv_budget_tokens=24)
    llm.generate(prompts[:2], params, use_tqdm=False)
    assert llm.engine.kv_manager.num_evicted_blocks > 0
    plain = make_llm(tiny_llama_dir, block_size=8)
    with pytest.raises(ValueError, match="kv_budget_tokens needs a KV eviction policy"):
        plain.generate(prompts[:1], params, use_tqdm=False)
    with pytest.raises(ValueError, match="paged"):
        make_llm(tiny_llama_dir, kv_layout="slab", kv_eviction="sink", kv_budget_tokens=32)


@pytest.mark.parametrize("policy", ["sink", "h2o"])
def test_native_backend_takes_positions_not_slots_under_eviction(tiny_llama_dir, policy):
    # Regression: the native kernels derive a token's RoPE angle from its KV slot; after an eviction that is
    # below its position, so such steps pass each request's offset (cvk.h's rope_offset). Streamed prompt
    # logprobs under eviction, native against the reference, agree to float32 rounding.
    from conveyor.kernels import load_cpu_kernels

    if load_cpu_kernels() is None:
        pytest.skip("native kernels not built here")
    prompt = make_prompts(1, seed=5, lo=160, hi=160)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    runs = []
    for backend in ("reference", "cpu"):
        llm = make_llm(tiny_llama_dir, block_size=4, max_num_batched_tokens=8, attention_backend=backend,
                       kv_eviction=policy, kv_budget_tokens=32, enable_prefix_caching=False)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert llm.engine.kv_manager.num_evicted_blocks > 0
        runs.append([e.logprob for e in out.prompt_logprobs if e is not None])
    assert runs[0] == pytest.approx(runs[1], abs=2e-3)


@pytest.mark.parametrize("policy", ["sink", "h2o"])
def test_native_layer_stack_runs_evicting_steps_bit_identical_to_the_per_layer_path(tiny_llama_dir, prompts,
                                                                                     policy):
    # The native kernels rotate shifted slots by their request's offset and add up the attention mass
    # themselves, so the one-call layer stack takes the steps that score (h2o) and those whose slots eviction
    # shifted; they give what the per-layer loop over the same kernels gives, token for token and logprob for
    # logprob (the same scores, so the same blocks evicted).
    llm = make_llm(tiny_llama_dir, block_size=4, max_num_batched_tokens=32, attention_backend="cpu",
                   kv_eviction=policy, kv_budget_tokens=24, enable_prefix_caching=False)
    model = llm.engine.model
    stack = model.native_stack
    if stack is None:
        pytest.skip("native kernels not built here")
    seen = []
    run = stack.run
    stack.run = lambda x, rope, kv, attn, *rest: seen.append((bool(attn.scored), attn.rope_offset is not None)) or \
        run(x, rope, kv, attn, *rest)
    try:
        fused = logprobs_of(llm.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        del stack.run
    assert any(shifted for _, shifted in seen)  # steps after an eviction ran in the stack
    assert any(scored for scored, _ in seen) == (policy == "h2o")
    evicted = llm.engine.kv_manager.num_evicted_blocks
    assert evicted > 0
    model.native_stack = None
    try:
        assert logprobs_of(llm.generate(prompts, GREEDY, use_tqdm=False)) == fused
    finally:
        model.native_stack = stack
    assert llm.engine.kv_manager.num_evicted_blocks == 2 * evicted
