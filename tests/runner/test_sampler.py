"""Each sampling option does what it says (vLLM semantics)."""

from __future__ import annotations

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.runner.input_batch import RequestState, SamplingMetadata
from conveyor.runner.sampler import Sampler

V = 50
EOS = 2


def req(i=0, prompt=(5, 6, 7), output=(), **params):
    p = SamplingParams(**params)
    gen = None if p.seed is None else torch.Generator().manual_seed(p.seed)
    return RequestState(f"r{i}", list(prompt) + list(output), len(prompt), p, 0, i, 0, gen)


def sample(sampler, logits, reqs):
    return sampler.sample(logits, SamplingMetadata.build(reqs))


def logits_for(n, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = logits_for(4)
    ids, lps = sample(Sampler([EOS]), logits.clone(), [req(i, temperature=0.0) for i in range(4)])
    assert ids == logits.argmax(-1).tolist() and lps == [None] * 4
    ids, _ = sample(Sampler([EOS]), logits.clone(), [req(i, temperature=0.8, top_k=1) for i in range(4)])
    assert ids == logits.argmax(-1).tolist()


def test_greedy_bfloat16_logits_pick_what_their_float32_copy_picks():
    # Plain greedy rows take the argmax in the logits' own dtype (native kernel for bfloat16): the same ids as
    # the full path, which converts to float32 first; min_tokens still bans EOS on that path.
    logits = (torch.randn(6, 3001, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie (exact in bfloat16): the first one wins
    logits[1, EOS] = 100.0
    want = logits.float().argmax(-1).tolist()
    ids, lps = sample(Sampler([EOS]), logits.clone(), [req(i, temperature=0.0) for i in range(6)])
    assert ids == want and ids[0] == 7 and ids[1] == EOS and lps == [None] * 6
    ids, _ = sample(Sampler([EOS]), logits.clone(), [req(i, temperature=0.0, min_tokens=2) for i in range(6)])
    assert ids[1] != EOS and ids[0] == 7


def test_seed_reproducible_regardless_of_batch():
    logits = logits_for(3)
    alone = sample(Sampler([EOS], seed=1), logits[1:2].clone(), [req(1, temperature=1.0, seed=42)])[0]
    mixed = sample(Sampler([EOS], seed=2), logits.clone(), [req(0, temperature=1.0), req(1, temperature=1.0, seed=42),
                                                            req(2, temperature=0.0)])[0]
    assert alone[0] == mixed[1]


def test_random_sampling_follows_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [1e-9] * (V - 3)]))
    sampler = Sampler([EOS], seed=0)
    draws = [sample(sampler, logits.clone(), [req(temperature=1.0)])[0][0] for _ in range(2000)]
    freq = torch.bincount(torch.tensor(draws), minlength=V)[:3].float() / len(draws)
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0)


def test_top_k_top_p_min_p_restrict_support():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1] + [0.0] * (V - 4)])
    logits = torch.log(probs + 1e-12)
    sampler = Sampler([EOS], seed=0)
    for params, allowed in (({"top_k": 2}, {0, 1}), ({"top_p": 0.65}, {0, 1}), ({"min_p": 0.6}, {0, 1}),
                            ({"top_k": 3, "top_p": 0.5}, {0, 1})):
        got = {sample(sampler, logits.clone(), [req(temperature=1.0, **params)])[0][0] for _ in range(200)}
        assert got == allowed, params


def test_penalties_change_the_right_logits():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 9], logits[0, 20] = 2.0, -1.0, 1.9
    from conveyor.runner.sampler import apply_penalties
    r = req(prompt=(5,), output=(9, 9, 20), repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = logits.clone()
    apply_penalties(out, [r], [0])
    assert out[0, 5] == pytest.approx(1.0)  # prompt token, positive: divided by 2, no output penalties
    assert out[0, 9] == pytest.approx(-2.0 - 2 * 0.5 - 0.25)  # negative: times 2, count 2, present
    assert out[0, 20] == pytest.approx(0.95 - 0.5 - 0.25)
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[[5, 9, 20]] = False
    assert (out[0, untouched] == 0).all()
    # and they steer greedy sampling: token 5 no longer wins
    ids, _ = sample(Sampler([EOS]), logits.clone(), [req(prompt=(5,), temperature=0.0, repetition_penalty=3.0)])
    assert ids == [20]


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(2, V)
    logits[:, EOS], logits[:, 7], logits[:, 3] = 10.0, 9.0, 8.0
    reqs = [req(0, output=(4,), temperature=0.0, min_tokens=2, stop_token_ids=[7]),
            req(1, output=(4, 4), temperature=0.0, min_tokens=2, stop_token_ids=[7])]
    assert sample(Sampler([EOS]), logits, reqs)[0] == [3, EOS]


def test_logprobs_are_raw_log_softmax():
    logits = logits_for(3)
    reqs = [req(0, temperature=0.0, logprobs=3), req(1, temperature=0.0), req(2, temperature=2.0, logprobs=0,
                                                                              repetition_penalty=1.5)]
    ids, lps = sample(Sampler([EOS]), logits.clone(), reqs)
    raw = torch.log_softmax(logits, -1)
    assert lps[1] is None and lps[2].top == []
    assert lps[0].token_id == ids[0] and lps[0].logprob == pytest.approx(raw[0, ids[0]].item(), abs=1e-5)
    top_vals, top_ids = raw[0].topk(3)
    assert [t for t, _ in lps[0].top] == top_ids.tolist()
    assert [v for _, v in lps[0].top] == pytest.approx(top_vals.tolist(), abs=1e-5)
    assert lps[2].logprob == pytest.approx(raw[2, ids[2]].item(), abs=1e-5)  # before temperature and penalties
