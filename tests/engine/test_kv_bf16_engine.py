"""The bfloat16 KV cache of a float32 model (``--kv-cache-dtype bfloat16``) in a real engine on the tiny Llama: its
blocks at half float32's bytes, greedy outputs unchanged by batching, prefix caching, preemption and speculation
(each row is rounded once, when it is written, so a recomputed or shared row is the same bits), and the refusals:
a backend that cannot read it, and a model dtype it does not hold."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.kernels import load_cpu_kernels
from tests.helpers.engine import make_prompts, token_ids

pytestmark = [pytest.mark.slow,  # a real model and engine
              pytest.mark.skipif(load_cpu_kernels() is None, reason="the bfloat16 cache is read by the native kernels")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


def make_llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float32", debug_invariants=True, kv_cache_dtype="bfloat16", **kw)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(5, lo=20, hi=90)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts):
    """bfloat16 K/V, one request at a time, no prefix cache: what every other run below must reproduce."""
    llm = make_llm(tiny_llama_dir, max_num_seqs=1, enable_prefix_caching=False)
    return token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))


def test_the_cache_is_bfloat16_and_holds_twice_the_blocks(tiny_llama_dir):
    auto = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=0.01)
    half = make_llm(tiny_llama_dir, kv_cache_memory=0.01)
    assert auto.engine.executor.kv_caches[0].dtype == torch.float32
    assert half.engine.executor.kv_caches[0].dtype == torch.bfloat16
    assert half.engine.num_kv_blocks // 2 == auto.engine.num_kv_blocks  # (floor division of the same budget)
    # a bfloat16 model's cache is already bfloat16: the same blocks as auto
    same = LLM(str(tiny_llama_dir), dtype="bfloat16", kv_cache_memory=0.01, kv_cache_dtype="bfloat16")
    bf16_auto = LLM(str(tiny_llama_dir), dtype="bfloat16", kv_cache_memory=0.01)
    assert same.engine.num_kv_blocks == bf16_auto.engine.num_kv_blocks


def test_batching_prefix_caching_preemption_and_speculation_change_no_output(tiny_llama_dir, prompts, reference):
    batched = make_llm(tiny_llama_dir, max_num_batched_tokens=32)
    assert token_ids(batched.generate(prompts, GREEDY, use_tqdm=False)) == reference
    again = batched.generate(prompts, GREEDY, use_tqdm=False)  # the prompts' blocks are cached now
    assert token_ids(again) == reference and sum(o.metrics.num_cached_tokens for o in again) > 0
    tight = make_llm(tiny_llama_dir, num_kv_blocks=16, block_size=8, max_model_len=120, max_num_batched_tokens=32)
    assert token_ids(tight.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert tight.engine.scheduler.num_preemptions > 0
    spec = make_llm(tiny_llama_dir, speculative_config=NGRAM, num_kv_blocks=16, block_size=8, max_model_len=120)
    assert token_ids(spec.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert spec.engine.scheduler.speculator.counters.num_accepted_tokens > 0


def test_refused_where_it_cannot_be_read(tiny_llama_dir):
    for backend in ("cpu-torch", "reference"):
        with pytest.raises(ValueError, match=f"native CPU attention kernels.*'{backend}'"):
            make_llm(tiny_llama_dir, attention_backend=backend)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, int8"):
        LLM(str(tiny_llama_dir), kv_cache_dtype="float16")
