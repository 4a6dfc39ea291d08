"""Engine-level equivalences: batching, chunking, block sizes, preemption and prefix caching change no greedy
output. Run in float64 so that random weights' near-ties cannot flip under float32 rounding differences."""

from __future__ import annotations

import random

import pytest

from conveyor import LLM, SamplingParams
from tests.helpers.engine import make_prompts, token_ids

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), dtype=kw.pop("dtype", "float64"), debug_invariants=True, **kw)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(10)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts):
    """Each prompt alone: one request at a time, no batching, no chunking."""
    llm = make_llm(tiny_llama_dir, max_num_seqs=1, policy="continuous", enable_prefix_caching=False)
    return [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]


@pytest.mark.parametrize(
    "knobs",
    [
        dict(policy="continuous"),
        dict(policy="chunked", max_num_batched_tokens=16),
        dict(policy="chunked", max_num_batched_tokens=64),
        dict(policy="chunked", block_size=1),
        dict(policy="chunked", block_size=32, max_num_batched_tokens=32),
        dict(policy="continuous", block_size=16, max_num_seqs=3),
    ],
    ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()),
)
def test_batched_equals_one_at_a_time(tiny_llama_dir, prompts, reference, knobs):
    llm = make_llm(tiny_llama_dir, **knobs)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference


def test_preemption_changes_no_output(tiny_llama_dir, prompts, reference):
    # 12 blocks of 8 tokens = 96 slots for 10 requests of up to 82 tokens: preemption must happen.
    llm = make_llm(tiny_llama_dir, num_kv_blocks=12, block_size=8, max_model_len=96, max_num_batched_tokens=32)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    assert token_ids(outs) == reference


def test_prefix_caching_hits_and_changes_no_output(tiny_llama_dir):
    rng = random.Random(7)
    system = [rng.randrange(4, 384) for _ in range(40)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(4, 384) for _ in range(rng.randint(2, 9))]}
               for _ in range(6)]
    off = make_llm(tiny_llama_dir, enable_prefix_caching=False, block_size=8)
    ref = [token_ids(off.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    computed = []
    on = make_llm(tiny_llama_dir, enable_prefix_caching=True, block_size=8)
    on.engine.step_listeners.append(lambda rec: computed.append(rec.num_prefill_tokens))
    outs = on.generate(prompts[:1], GREEDY, use_tqdm=False) + on.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert token_ids(outs) == ref
    assert on.engine.kv_manager.prefix_hits >= 5 * 40 // 8 * 8
    assert all(o.metrics.num_cached_tokens == 40 for o in outs[1:])
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    assert sum(computed) <= prompt_tokens - 5 * 40  # the shared system prompt was computed once


def test_n_completions_share_prompt_blocks(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, enable_prefix_caching=False, block_size=4)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate([make_prompts(1, hi=20, lo=20)[0]], params, use_tqdm=False)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 6 for o in out.outputs)
    assert llm.engine.kv_manager.prefix_hits >= 2 * 16  # siblings reused the first child's prompt blocks
    again = llm.generate([make_prompts(1, hi=20, lo=20)[0]], params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]  # seeded: reproducible


def test_bad_values_raise_clear_errors_and_engine_keeps_working(tiny_llama_dir, tmp_path):
    llm = make_llm(tiny_llama_dir, max_model_len=64, dtype="float32")
    with pytest.raises(ValueError, match="max_model_len|context"):
        llm.generate([{"prompt_token_ids": [5] * 80}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="prompt token ids"):
        llm.generate([{"prompt_token_ids": [5, 99999]}], GREEDY, use_tqdm=False)
    with pytest.raises((FileNotFoundError, ValueError), match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))
    # a batch with one bad prompt queues nothing; the engine still serves good requests afterwards
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5] * 80}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"


def test_text_prompts_stop_strings_and_eos(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, dtype="float32")
    (free,) = llm.generate(["w10 w11 w12"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
    words = free.outputs[0].text.split()
    tok = llm.tokenizer
    assert len(words) == 8  # incremental detokenization continues the prompt's text exactly:
    assert tok.decode(free.prompt_token_ids + free.outputs[0].token_ids) == tok.decode(free.prompt_token_ids) + free.outputs[0].text
    stop = words[3]
    (cut,) = llm.generate(["w10 w11 w12"], SamplingParams(temperature=0, max_tokens=8, stop=[stop]), use_tqdm=False)
    first = words.index(stop)
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.outputs[0].text.split() == words[:first]
    # the generated token that ends the text becomes an EOS: generation stops there unless ignore_eos
    eos_tok = free.outputs[0].token_ids[2]
    (ended,) = llm.generate(["w10 w11 w12"], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[eos_tok]),
                            use_tqdm=False)
    assert ended.outputs[0].token_ids == free.outputs[0].token_ids[: free.outputs[0].token_ids.index(eos_tok) + 1]
    assert ended.outputs[0].stop_reason == eos_tok


def test_reset_prefix_cache_forgets_prompts(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=8, dtype="float32")
    prompt = make_prompts(1, lo=40, hi=40)
    llm.generate(prompt, GREEDY, use_tqdm=False)
    llm.engine.reset_prefix_cache()
    (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert out.metrics.num_cached_tokens == 0
    (again,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert again.metrics.num_cached_tokens == 32  # without a reset the same prompt hits 4 full blocks
    make_llm(tiny_llama_dir, kv_layout="slab", max_model_len=64, dtype="float32").engine.reset_prefix_cache()
