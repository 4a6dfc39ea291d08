"""The KV caches of another element type than the model's (``--kv-cache-dtype int8`` and ``bfloat16``) in a real engine
on the tiny Llama: their blocks (int8 at a quarter of float32's bytes plus the scales, bfloat16 at half), greedy
outputs unchanged by batching, prefix caching, preemption and speculation (each row is quantized or rounded once,
when it is written, so a recomputed or shared row is the same bytes), KV eviction by score over the stored keys,
and the refusals: vLLM's fp8 names, a backend that cannot read the rows, an unknown name."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.kernels import load_cpu_kernels
from tests.helpers.checkpoints import save_tiny_llama
from tests.helpers.engine import make_prompts, token_ids

pytestmark = [pytest.mark.slow,  # a real model and engine
              pytest.mark.skipif(load_cpu_kernels() is None, reason="these caches are read by the native kernels")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
CACHE_DTYPES = {"int8": torch.int8, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module", params=sorted(CACHE_DTYPES))
def kv(request) -> str:
    return request.param


def make_llm(model_dir, kv: str, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float32", debug_invariants=True, kv_cache_dtype=kv, **kw)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(5, lo=20, hi=90)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts, kv):
    """The cache type, one request at a time, no prefix cache: what every other run below must reproduce."""
    llm = make_llm(tiny_llama_dir, kv, max_num_seqs=1, enable_prefix_caching=False)
    return token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))


def test_the_cache_is_int8_rows_and_holds_more_blocks(tiny_llama_dir):
    auto = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=0.01)
    int8 = make_llm(tiny_llama_dir, "int8", kv_cache_memory=0.01)
    d = auto.engine.model_info.head_dim  # 16: rows of 64 bytes in float32, 16 + 4 in int8
    cache = int8.engine.executor.kv_caches[0]
    assert cache.dtype == torch.int8 and cache.shape[-1] == d + 4
    assert int8.engine.num_kv_blocks == int(0.01 * (1 << 30)) // (2 * 2 * 16 * 2 * (d + 4))
    assert int8.engine.num_kv_blocks // auto.engine.num_kv_blocks == (4 * d) // (d + 4)


def test_the_cache_is_bfloat16_and_holds_twice_the_blocks(tiny_llama_dir):
    auto = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=0.01)
    half = make_llm(tiny_llama_dir, "bfloat16", kv_cache_memory=0.01)
    assert auto.engine.executor.kv_caches[0].dtype == torch.float32
    assert half.engine.executor.kv_caches[0].dtype == torch.bfloat16
    assert half.engine.num_kv_blocks // 2 == auto.engine.num_kv_blocks  # (floor division of the same budget)
    # a bfloat16 model's cache is bfloat16 already: the same blocks as auto
    same = LLM(str(tiny_llama_dir), dtype="bfloat16", kv_cache_memory=0.01, kv_cache_dtype="bfloat16")
    bf16_auto = LLM(str(tiny_llama_dir), dtype="bfloat16", kv_cache_memory=0.01)
    assert same.engine.num_kv_blocks == bf16_auto.engine.num_kv_blocks


def test_batching_prefix_caching_and_preemption_change_no_output(tiny_llama_dir, prompts, reference, kv):
    batched = make_llm(tiny_llama_dir, kv, max_num_batched_tokens=32)
    assert token_ids(batched.generate(prompts, GREEDY, use_tqdm=False)) == reference
    again = batched.generate(prompts, GREEDY, use_tqdm=False)  # the prompts' blocks are cached now
    assert token_ids(again) == reference and sum(o.metrics.num_cached_tokens for o in again) > 0
    tight = make_llm(tiny_llama_dir, kv, num_kv_blocks=16, block_size=8, max_model_len=120,
                     max_num_batched_tokens=32)
    assert token_ids(tight.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert tight.engine.scheduler.num_preemptions > 0


def test_speculation_changes_no_output(tiny_llama_dir, prompts, reference, kv, tmp_path_factory):
    llm = make_llm(tiny_llama_dir, kv, speculative_config=NGRAM, num_kv_blocks=16, block_size=8, max_model_len=120)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert llm.engine.scheduler.speculator.counters.num_accepted_tokens > 0
    draft = save_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), seed=1, hidden_size=32, num_attention_heads=2,
                            num_key_value_heads=1, num_hidden_layers=1)
    drafted = make_llm(tiny_llama_dir, kv, speculative_config={"model": str(draft), "num_speculative_tokens": 3,
                                                               "adaptive": False})
    assert token_ids(drafted.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert drafted.engine.executor.draft.kv_caches[0].dtype == CACHE_DTYPES[kv]  # the draft's K/V in the same blocks


def test_kv_eviction_by_score_runs_over_the_stored_keys(tiny_llama_dir, prompts, kv):
    """h2o ranks blocks by the attention mass the kernels add up over the keys as stored (dequantized, widened)."""
    budget, block = 32, 8
    llm = make_llm(tiny_llama_dir, kv, block_size=block, max_num_batched_tokens=64, kv_eviction="h2o",
                   kv_budget_tokens=budget, enable_prefix_caching=False)
    manager = llm.engine.kv_manager
    most = []
    llm.engine.step_listeners.append(lambda rec: most.append(max((len(b) for b in manager.req_blocks.values()),
                                                                 default=0)))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert manager.num_evicted_blocks > 0 and max(most) * block <= budget + block
    assert manager.pool.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_vllm_fp8_names_are_refused_by_name(tiny_llama_dir, name):
    with pytest.raises(ValueError, match=f"kv_cache_dtype '{name}'.*8-bit floats.*'int8'"):
        LLM(str(tiny_llama_dir), kv_cache_dtype=name)


def test_a_backend_that_cannot_read_the_rows_is_refused_at_load(tiny_llama_dir, kv):
    for backend in ("cpu-torch", "reference"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype '{kv}' is read only by the native CPU attention "
                                             f"kernels.*'{backend}'"):
            make_llm(tiny_llama_dir, kv, attention_backend=backend)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, int8"):
        LLM(str(tiny_llama_dir), kv_cache_dtype="int4")
