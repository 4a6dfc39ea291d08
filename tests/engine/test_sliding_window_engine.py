"""A sliding-window model in the engine (tiny random Mistral, window 8, written by transformers): giving back the
blocks outside the window changes no token and no logprob (batched with chunked prefill, preemption and prefix-
cache hits, prompts several windows long), admits more requests at once in the same KV memory, and the given-back
blocks are never read by any backend: filled with NaN, they change nothing."""

from __future__ import annotations

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm import LLM
from conveyor.kernels import load_cpu_kernels
from tests.helpers.families import VOCAB, save_tiny

pytestmark = pytest.mark.slow  # a real model and engine
pytest.importorskip("transformers")

WINDOW = 8
GEN = torch.Generator().manual_seed(1)
SHARED = torch.randint(8, VOCAB, (20,), generator=GEN).tolist()  # a prefix longer than two windows
PROMPTS = [{"prompt_token_ids": SHARED + torch.randint(8, VOCAB, (4 + 4 * i,), generator=GEN).tolist()}
           for i in range(6)]  # 24 .. 44 tokens: three to five windows
PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
# 16 blocks of 4 tokens: one 64-token sequence whole, so six requests preempt each other
TIGHT = dict(num_kv_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=12, debug_invariants=True)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mistral")
    save_tiny(path, "mistral")
    return str(path)


def results(outs) -> list:
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs or ()]) for o in outs]


def run(llm: LLM, params: SamplingParams = PARAMS) -> tuple[list, int]:
    """(tokens and logprobs of every prompt, the most requests running at once), the first prompt cached before."""
    peak = []
    llm.engine.step_listeners.append(lambda record: peak.append(record.num_running))
    llm.generate(PROMPTS[:1], params, use_tqdm=False)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert sum(o.metrics.num_cached_tokens for o in outs) >= 5 * 16  # the shared prefix's blocks, hit
    return results(outs), max(peak)


def test_freeing_outside_the_window_changes_no_token_or_logprob(mistral):
    """float64 (the torch backend), so that batches of other shapes round alike: identical tokens and logprobs."""
    results = {}
    for free in (True, False):
        llm = LLM(mistral, dtype="float64", free_outside_window=free, **TIGHT)
        assert llm.engine.model_info.layer_windows == (WINDOW, WINDOW)
        assert (llm.engine.kv_manager.null_block_id is not None) == free
        results[free] = run(llm)
        assert llm.engine.scheduler.num_preemptions > 0
    (freed, freed_peak), (held, held_peak) = results[True], results[False]
    assert freed == held
    assert freed_peak > held_peak  # the same 16 blocks run more requests at once
    # n-gram speculation beside it: proposals' lookahead blocks and their rollback next to the given-back blocks
    spec = LLM(mistral, dtype="float64", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                              "prompt_lookup_min": 1, "adaptive": False}, **TIGHT)
    tokens, _ = run(spec, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # (logprobs: no proposals)
    assert [t for t, _ in tokens] == [t for t, _ in freed]
    assert spec.engine.scheduler.speculator.counters.num_drafts > 0


# (backend, policy): static pads its batches (PaddedAttention around the backend)
BACKENDS = [("reference", "chunked"), ("reference", "static"), ("cpu-torch", "chunked")]
if load_cpu_kernels() is not None:
    BACKENDS.append(("cpu-native", "chunked"))


@pytest.mark.parametrize("backend,policy", BACKENDS)
def test_blocks_given_back_are_never_read(mistral, backend, policy):
    """Every block in the pool's free list is poisoned before each step (and a block handed out is zeroed first,
    as a fresh cache is): a table entry still pointing at a given-back block would read it. NaN where the backend
    allocates its cache uninitialised (a masked score's weight times a NaN V is NaN); cpu-torch, whose cache starts
    zeroed and whose padded decode gathers read whole rows of the table, masked, gets another request's kind of
    K/V: large finite values. The outputs equal the same run's without the poison, bit for bit. (Prefix caching
    off: a free block keeps its K/V for a later hit only when it carries a key.)"""
    poison_value = float("nan") if backend != "cpu-torch" else 1e4

    def generate(poison: bool):
        llm = LLM(mistral, dtype="float32", attention_backend=backend, policy=policy, max_num_seqs=4,
                  enable_prefix_caching=False, **{**TIGHT, "num_kv_blocks": 20})
        engine = llm.engine
        runner, kv = engine.executor, engine.kv_manager
        execute = runner.execute

        skipped = [0]

        def poisoned(so):
            skipped[0] = max(skipped[0], sum(kv.num_skipped.values()))
            fresh = [b for n in so.scheduled_new_reqs for b in n.block_ids if b != kv.null_block_id]
            fresh += [b for c in so.scheduled_cached_reqs for b in c.new_block_ids]
            free = [b.block_id for b in kv.pool.free_list]
            for cache in runner.kv_caches:  # [2, blocks, ...] in every backend's layout
                cache[:, free] = poison_value
                cache[:, fresh] = 0.0
            return execute(so)

        if poison:
            runner.execute = poisoned
        outs = llm.generate(PROMPTS[2:], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0),
                            use_tqdm=False)  # four prompts of 32 .. 44 tokens: four to five windows
        assert skipped[0] > 0 or not poison  # blocks were given back, and poisoned while free
        return results(outs)

    clean = generate(poison=False)
    assert all(not torch.tensor(lps).isnan().any() for _, lps in clean)
    assert generate(poison=True) == clean
