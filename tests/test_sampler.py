"""Each sampling option does what it says (vLLM semantics); pad tokens compute without touching the cache."""

from __future__ import annotations

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.runner.input_batch import RequestState
from conveyor.runner.sampler import Sampler

V = 50
EOS = 2


def req(i=0, prompt=(5, 6, 7), output=(), **params):
    p = SamplingParams(**params)
    gen = None if p.seed is None else torch.Generator().manual_seed(p.seed)
    return RequestState(f"r{i}", list(prompt) + list(output), len(prompt), p, 0, i, 0, gen)


def logits_for(n, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = logits_for(4)
    ids, lps = Sampler([EOS]).sample(logits.clone(), [req(i, temperature=0.0) for i in range(4)])
    assert ids == logits.argmax(-1).tolist() and lps == [None] * 4
    ids, _ = Sampler([EOS]).sample(logits.clone(), [req(i, temperature=0.8, top_k=1) for i in range(4)])
    assert ids == logits.argmax(-1).tolist()


def test_greedy_bfloat16_logits_pick_what_their_float32_copy_picks():
    # Plain greedy rows take the argmax in the logits' own dtype (native kernel for bfloat16): the same ids as
    # the full path, which converts to float32 first; min_tokens still bans EOS on that path.
    logits = (torch.randn(6, 3001, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie (exact in bfloat16): the first one wins
    logits[1, EOS] = 100.0
    want = logits.float().argmax(-1).tolist()
    ids, lps = Sampler([EOS]).sample(logits.clone(), [req(i, temperature=0.0) for i in range(6)])
    assert ids == want and ids[0] == 7 and ids[1] == EOS and lps == [None] * 6
    ids, _ = Sampler([EOS]).sample(logits.clone(), [req(i, temperature=0.0, min_tokens=2) for i in range(6)])
    assert ids[1] != EOS and ids[0] == 7


def test_seed_reproducible_regardless_of_batch():
    logits = logits_for(3)
    alone = Sampler([EOS], seed=1).sample(logits[1:2].clone(), [req(1, temperature=1.0, seed=42)])[0]
    mixed = Sampler([EOS], seed=2).sample(logits.clone(), [req(0, temperature=1.0), req(1, temperature=1.0, seed=42),
                                                            req(2, temperature=0.0)])[0]
    assert alone[0] == mixed[1]


def test_random_sampling_follows_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [1e-9] * (V - 3)]))
    sampler = Sampler([EOS], seed=0)
    draws = [sampler.sample(logits.clone(), [req(temperature=1.0)])[0][0] for _ in range(2000)]
    freq = torch.bincount(torch.tensor(draws), minlength=V)[:3].float() / len(draws)
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0)


def test_top_k_top_p_min_p_restrict_support():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1] + [0.0] * (V - 4)])
    logits = torch.log(probs + 1e-12)
    sampler = Sampler([EOS], seed=0)
    for params, allowed in (({"top_k": 2}, {0, 1}), ({"top_p": 0.65}, {0, 1}), ({"min_p": 0.6}, {0, 1}),
                            ({"top_k": 3, "top_p": 0.5}, {0, 1})):
        got = {sampler.sample(logits.clone(), [req(temperature=1.0, **params)])[0][0] for _ in range(200)}
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
    ids, _ = Sampler([EOS]).sample(logits.clone(), [req(prompt=(5,), temperature=0.0, repetition_penalty=3.0)])
    assert ids == [20]


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(2, V)
    logits[:, EOS], logits[:, 7], logits[:, 3] = 10.0, 9.0, 8.0
    reqs = [req(0, output=(4,), temperature=0.0, min_tokens=2, stop_token_ids=[7]),
            req(1, output=(4, 4), temperature=0.0, min_tokens=2, stop_token_ids=[7])]
    assert Sampler([EOS]).sample(logits, reqs)[0] == [3, EOS]


def test_logprobs_are_raw_log_softmax():
    logits = logits_for(3)
    reqs = [req(0, temperature=0.0, logprobs=3), req(1, temperature=0.0), req(2, temperature=2.0, logprobs=0,
                                                                              repetition_penalty=1.5)]
    ids, lps = Sampler([EOS]).sample(logits.clone(), reqs)
    raw = torch.log_softmax(logits, -1)
    assert lps[1] is None and lps[2].top == []
    assert lps[0].token_id == ids[0] and lps[0].logprob == pytest.approx(raw[0, ids[0]].item(), abs=1e-5)
    top_vals, top_ids = raw[0].topk(3)
    assert [t for t, _ in lps[0].top] == top_ids.tolist()
    assert [v for _, v in lps[0].top] == pytest.approx(top_vals.tolist(), abs=1e-5)
    assert lps[2].logprob == pytest.approx(raw[2, ids[2]].item(), abs=1e-5)  # before temperature and penalties


@pytest.mark.slow  # the embedded 40M model
def test_padding_tokens_are_computed_but_change_nothing():
    from conveyor.bench.step_builder import StepBuilder
    from conveyor.models import EMBEDDED_NAME, load_model
    from tests.helpers.runner import LogitsRecordingRunner

    model, info = load_model(EMBEDDED_NAME)
    model.native_stack = None  # the hook below sees the per-layer path; the one-call stack (test_native_stack) skips it
    rows_seen = []
    hook = model.layers[-1].mlp.register_forward_hook(lambda mod, args, out: rows_seen.append(out.shape[0]))
    runs = []
    for pad in (0, 7):
        runner = LogitsRecordingRunner(model, info, num_blocks=32, block_size=16)
        for cache in runner.kv_caches:  # the native CPU backend starts with its cache unwritten: make it known
            cache.zero_()
        sched = StepBuilder(16, 32, shuffle_seed=0)
        sched.add("a", list(range(100, 120)))
        sched.run(runner, {"a": None}, num_padding_tokens=pad)
        sched.run(runner, {"a": 1}, num_padding_tokens=pad)
        runs.append((sched.tokens["a"], runner.last_logits["a"], [c.clone() for c in runner.kv_caches]))
    hook.remove()
    assert rows_seen == [20, 1, 27, 8]  # the pad rows really went through the whole stack
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1])
    for c0, c1 in zip(runs[0][2], runs[1][2]):
        torch.testing.assert_close(c0, c1)  # pad tokens wrote nothing anywhere


def test_draw_never_picks_a_token_of_probability_zero():
    from conveyor.runner.sampler import CDF_BLOCK, draw_tokens

    # Two blocks (the second ragged); positive weight only at 1 and at CDF_BLOCK + 3.
    vocab = CDF_BLOCK + 5
    weights = torch.zeros(6, vocab)
    weights[:, 1] = 1.0
    weights[:, CDF_BLOCK + 3] = 1.0
    # u = 1.0 cannot come from torch.rand; it stands for a target rounded up onto the total
    u = torch.tensor([[0.0], [0.25], [0.4999], [0.5], [0.999999999], [1.0]], dtype=torch.float64)
    assert draw_tokens(weights, u).tolist() == [1, 1, 1, CDF_BLOCK + 3, CDF_BLOCK + 3, CDF_BLOCK + 3]


def stratified(n: int) -> torch.Tensor:
    """n evenly spaced uniforms: an inverse-CDF draw then hits each token in proportion to its probability
    to within 1/n, so frequencies can be checked tightly without random noise."""
    return ((torch.arange(n, dtype=torch.float64) + 0.5) / n).unsqueeze(1)


def test_draw_follows_a_spread_distribution_across_blocks():
    from conveyor.runner.sampler import draw_tokens

    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3)) * 2
    probs = logits.softmax(dim=-1)[0].double()
    n = 20000
    draws = draw_tokens((logits - logits.max()).exp().expand(n, -1).contiguous(), stratified(n))
    freq = torch.bincount(draws, minlength=1000).double() / n
    torch.testing.assert_close(freq, probs, atol=2.0 / n, rtol=0)


def reference_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """vLLM's top-k / top-p over a full sort (what the sampler did before draw_truncated): -inf outside."""
    logits = logits.clone()
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks])
    kth = sorted_logits.gather(1, (vocab - ks).unsqueeze(1))
    sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = cum <= 1.0 - torch.tensor(top_ps).unsqueeze(1)
    outside[:, -1] = False
    sorted_logits.masked_fill_(outside, float("-inf"))
    return logits.scatter_(-1, order, sorted_logits)


@pytest.mark.parametrize("windows", ["default", "narrow", "few tokens"])  # the last two: the exact fallbacks too
@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 12.0])  # flat rows to peaked ones
def test_truncated_draw_matches_a_full_sort(scale, windows, monkeypatch):
    from conveyor.runner import sampler
    from conveyor.runner.sampler import draw_truncated

    if windows == "narrow":
        monkeypatch.setattr(sampler, "TRUNCATION_WINDOWS", (1e-6,))
    if windows == "few tokens":
        monkeypatch.setattr(sampler, "WINDOW_MAX_TOKENS", 3)

    vocab, n = 1000, 2000
    # top-k up to DIRECT_TOP_K goes straight to torch.topk; 300 and 600 go through the windows
    cases = [(0, 0.9), (40, 1.0), (40, 0.8), (0, 0.5), (1, 1.0), (5000, 0.95), (3, 0.2), (300, 0.9), (600, 1.0)]
    logits = torch.randn(len(cases), vocab, generator=torch.Generator().manual_seed(int(scale * 10))) * scale
    ks, ps = [k for k, _ in cases], [p for _, p in cases]
    expected = reference_top_k_top_p(logits, ks, ps).softmax(dim=-1).double()
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    for i, (k, p) in enumerate(cases):
        draws = draw_truncated(weights[i:i + 1].expand(n, -1).contiguous(), [k] * n, [p] * n, stratified(n))
        freq = torch.bincount(draws, minlength=vocab).double() / n
        assert (freq[expected[i] == 0] == 0).all(), f"case {(k, p)}: drew a token outside the nucleus"
        torch.testing.assert_close(freq, expected[i], atol=2.0 / n, rtol=0)


def test_truncated_draw_leaves_a_row_without_truncation_whole():
    from conveyor.runner.sampler import draw_truncated

    n, vocab = 2000, 300
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(9))
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    batch = weights.repeat_interleave(n, dim=0)  # rows 0..n-1: top-k 2; rows n..2n-1: no truncation
    draws = draw_truncated(batch, [2] * n + [0] * n, [1.0] * (2 * n), torch.cat([stratified(n), stratified(n)]))
    top2 = set(logits[0].topk(2).indices.tolist())
    assert set(draws[:n].tolist()) <= top2
    freq = torch.bincount(draws[n:], minlength=vocab).double() / n
    torch.testing.assert_close(freq, logits[1].softmax(dim=-1).double(), atol=2.0 / n, rtol=0)
