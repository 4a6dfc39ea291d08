"""Prompt logprobs (vLLM's ``prompt_logprobs``, what ``echo`` serves) equal transformers' log-softmax of the prompt,
however the prompt is chunked, when an identical prompt sits in the prefix cache, and for n > 1."""

from __future__ import annotations

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm import LLM

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float64).eval()
    prompt = torch.randint(4, 384, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
    return prompt, logprobs


@pytest.mark.parametrize("budget", [16, 2048])
def test_prompt_logprobs_match_transformers(tiny_llama_dir, reference, budget):
    prompt, ref = reference
    llm = LLM(str(tiny_llama_dir), dtype="float64", num_kv_blocks=64, max_num_batched_tokens=budget,
              debug_invariants=True)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)  # now it is cached
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, [params, SamplingParams(max_tokens=2, n=2, seed=1,
                                                                                     prompt_logprobs=0)],
                        use_tqdm=False)
    for out, top_n in zip(outs, (3, 0)):
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        got = torch.tensor([e.logprob for e in entries[1:]], dtype=torch.float64)
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        for i, e in enumerate(entries[1:]):
            assert e.token_id == prompt[i + 1] and len(e.top) == top_n
            assert e.rank == int((ref[i] > ref[i, prompt[i + 1]]).sum()) + 1
            assert [t for t, _ in e.top] == ref[i].topk(top_n).indices.tolist()


def test_prompt_logprobs_survive_preemption(tiny_llama_dir, reference):
    """Too few KV blocks for all four: some are preempted and recomputed; each keeps one entry per position."""
    prompt, ref = reference
    llm = LLM(str(tiny_llama_dir), dtype="float64", num_kv_blocks=12, block_size=16, max_num_batched_tokens=32,
              max_model_len=192, debug_invariants=True)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": prompt[:60 - i]} for i in range(4)], params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for out in outs:
        n = len(out.prompt_token_ids)
        got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]], dtype=torch.float64)
        torch.testing.assert_close(got, ref[torch.arange(n - 1), torch.tensor(prompt[1:n])], atol=1e-6, rtol=0)
