"""Speculative decoding (n-gram prompt lookup, and a draft model) in the real engine on the tiny Llama: greedy
outputs identical to decoding without it, under chunked prefill, preemption and prefix caching; sampled requests
in the same batch unchanged; the counters on /metrics. In float64, so that near-ties cannot flip between the verification's chunk
path and the decode path."""

from __future__ import annotations

import httpx
import pytest

from conveyor import LLM, SamplingParams
from tests.helpers.checkpoints import save_tiny_llama
from tests.helpers.engine import make_prompts, token_ids
from tests.helpers.stats import chi2_critical, two_sample_chi2

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def draft_config(model_dir, **kw) -> dict:
    return {"model": str(model_dir), "num_speculative_tokens": 4, "adaptive": False, **kw}


def make_llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float64", debug_invariants=True, **kw)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(10)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller tiny Llama on the target's vocabulary, of other random weights: its proposals are mostly wrong."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), seed=1, hidden_size=32, num_attention_heads=2,
                           num_key_value_heads=1, num_hidden_layers=1)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts):
    return token_ids(make_llm(tiny_llama_dir).generate(prompts, GREEDY, use_tqdm=False))


def test_step_records_count_the_verified_proposals(tiny_llama_dir, prompts):
    llm = make_llm(tiny_llama_dir, speculative_config=NGRAM)
    steps = []
    llm.engine.step_listeners.append(steps.append)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    counters = llm.engine.scheduler.speculator.counters
    assert sum(s.num_spec_tokens for s in steps) == counters.num_draft_tokens > 0
    assert sum(s.num_verifying_reqs for s in steps) == counters.num_drafts
    # a verifying request is a multi-token row: its last token and its proposals count with the prompt work
    assert all(s.num_prefill_tokens >= s.num_spec_tokens + s.num_verifying_reqs for s in steps)


@pytest.mark.parametrize("knobs", [
    dict(adaptive=True),  # its lengths follow the measured step times: it may choose not to speculate
    dict(),
    dict(max_num_batched_tokens=16),  # prompts in chunks beside the proposals
    dict(block_size=1),
    dict(max_num_seqs=1),
], ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_greedy_output_is_identical_with_speculation(tiny_llama_dir, prompts, reference, knobs):
    spec = {**NGRAM, "adaptive": knobs.get("adaptive", False)}
    llm = make_llm(tiny_llama_dir, speculative_config=spec, **{k: v for k, v in knobs.items() if k != "adaptive"})
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    counters = llm.engine.scheduler.speculator.counters
    if not spec["adaptive"]:
        assert counters.num_drafts > 0 and counters.num_accepted_tokens > 0  # it did speculate, and some paid
    assert llm.engine.kv_manager.usage() == 0


def test_preemption_and_prefix_caching_with_speculation_change_no_output(tiny_llama_dir, prompts, reference):
    llm = make_llm(tiny_llama_dir, num_kv_blocks=16, block_size=8, max_model_len=128, max_num_batched_tokens=32,
                   speculative_config=NGRAM)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    cached = make_llm(tiny_llama_dir, speculative_config=NGRAM)
    assert token_ids(cached.generate(prompts, GREEDY, use_tqdm=False)) == reference
    again = cached.generate(prompts, GREEDY, use_tqdm=False)  # the prompts' blocks are cached now
    assert token_ids(again) == reference
    assert sum(o.metrics.num_cached_tokens for o in again) > 0


def test_sampled_requests_beside_speculating_ones_are_unchanged(tiny_llama_dir, prompts):
    sampled = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=30, ignore_eos=True)
               for i in range(5)]
    params = sampled + [GREEDY] * 5
    plain = token_ids(make_llm(tiny_llama_dir).generate(prompts, params, use_tqdm=False))
    llm = make_llm(tiny_llama_dir, speculative_config=NGRAM)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == plain
    assert llm.engine.scheduler.speculator.counters.num_drafts > 0


def test_bad_speculative_config_is_a_clear_error(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="speculative method"):
        make_llm(tiny_llama_dir, speculative_config={"method": "medusa"})
    other_vocab = save_tiny_llama(tmp_path / "other-vocab", vocab_size=80)
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(tiny_llama_dir, speculative_config=draft_config(other_vocab))


@pytest.mark.parametrize("knobs", [
    dict(),
    dict(adaptive=True),
    dict(max_num_batched_tokens=16),
    dict(block_size=1),
    dict(max_num_seqs=1),
], ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_greedy_output_is_identical_with_a_draft_model(tiny_llama_dir, draft_dir, prompts, reference, knobs):
    """Two drafts: another model (its proposals mostly rejected) and the target itself (nearly all accepted,
    which checks that the draft's K/V, caught up lazily and rolled back, is the target's own)."""
    adaptive = knobs.pop("adaptive", False)
    for draft, accepted in ((draft_dir, None), (tiny_llama_dir, 0.9)):
        llm = make_llm(tiny_llama_dir, speculative_config=draft_config(draft, adaptive=adaptive), **knobs)
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
        counters = llm.engine.scheduler.speculator.counters
        if not adaptive:
            assert counters.num_drafts > 0
            if accepted is not None:
                assert counters.num_accepted_tokens >= accepted * counters.num_draft_tokens, counters
        assert llm.engine.kv_manager.usage() == 0


def test_a_draft_model_under_preemption_and_prefix_caching_changes_no_output(tiny_llama_dir, prompts,
                                                                           reference):
    """The target as its own draft: after a preemption, and after a prefix-cache hit (whose shared blocks'
    draft K/V was written by another request), the draft catches up from the first token and still agrees."""
    spec = draft_config(tiny_llama_dir)
    llm = make_llm(tiny_llama_dir, num_kv_blocks=24, block_size=8, max_model_len=128, max_num_batched_tokens=32,
                   speculative_config=spec)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    cached = make_llm(tiny_llama_dir, speculative_config=spec)
    cached.generate(prompts, GREEDY, use_tqdm=False)
    before = cached.engine.scheduler.speculator.counters.num_draft_tokens
    again = cached.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(again) == reference and sum(o.metrics.num_cached_tokens for o in again) > 0
    counters = cached.engine.scheduler.speculator.counters
    assert counters.num_draft_tokens > before and counters.num_accepted_tokens >= 0.9 * counters.num_draft_tokens
    assert cached.engine.kv_manager.usage() == 0


def test_metrics_expose_the_spec_decode_counters(tiny_chat_dir):
    from tests.helpers.server import serve_model

    with serve_model(tiny_chat_dir, speculative_config=NGRAM) as (url, _):
        body = {"model": "tiny", "prompt": "w5 w6 w7 w5 w6 w7 w5 w6", "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        text = httpx.get(url + "/metrics", timeout=10).text
    drafts = [line for line in text.splitlines() if line.startswith("conveyor:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0
    assert "conveyor:spec_decode_num_accepted_tokens_per_pos_total" in text


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampled_requests_keep_their_distribution_under_speculation(tiny_llama_dir, proposer):
    """Rejection sampling of n-gram proposals and of a draft model's greedy ones (the target as its own draft):
    each output position's token distribution, and the joint of two neighbouring positions, with speculation
    equal those without it (two-sample chi-square, p = 1e-4 each), over 1,500 unseeded draws at temperature 1
    with top-k 4 (so the proposals are often right and often wrong)."""
    # the model's own greedy continuation in the prompt: its likely tokens have been seen, so lookups propose
    seed = {"prompt_token_ids": [11, 12, 13, 14]}
    greedy = make_llm(tiny_llama_dir).generate([seed], SamplingParams(temperature=0.0, max_tokens=30,
                                                                      ignore_eos=True), use_tqdm=False)
    prompt = {"prompt_token_ids": seed["prompt_token_ids"] + token_ids(greedy)[0]}
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=8, ignore_eos=True)
    proposer = {"ngram": {**NGRAM, "num_speculative_tokens": 3, "adaptive": False},
                "draft": draft_config(tiny_llama_dir, num_speculative_tokens=3)}[proposer]
    n = 1500

    def draws(spec):
        llm = make_llm(tiny_llama_dir, speculative_config=spec, enable_prefix_caching=False, max_num_seqs=128,
                       max_num_batched_tokens=8192)  # room for proposals beside the prompts
        outs = token_ids(llm.generate([prompt] * n, params, use_tqdm=False))
        return outs, llm.engine.scheduler.speculator

    plain, _ = draws(None)
    spec, speculator = draws(proposer)
    counters = speculator.counters
    assert counters.num_drafts > n // 4  # many verified proposals...
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # ...some kept, some rejected
    samples = [([o[i] for o in plain], [o[i] for o in spec]) for i in range(8)]
    samples += [([tuple(o[i:i + 2]) for o in plain], [tuple(o[i:i + 2]) for o in spec]) for i in (1, 4)]
    for a, b in samples:
        stat, df = two_sample_chi2(a, b)
        assert df >= 1 and stat < chi2_critical(df), (stat, df)
