"""The inverse-CDF draws (runner.sampling_draws) pick each token with its probability, never one of probability
zero, and truncate to top-k / top-p exactly as a full sort would."""

from __future__ import annotations

import pytest
import torch

def test_draw_never_picks_a_token_of_probability_zero():
    from conveyor.runner.sampling_draws import CDF_BLOCK, draw_tokens

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
    from conveyor.runner.sampling_draws import draw_tokens

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
    from conveyor.runner import sampling_draws
    from conveyor.runner.sampling_draws import draw_truncated

    if windows == "narrow":
        monkeypatch.setattr(sampling_draws, "TRUNCATION_WINDOWS", (1e-6,))
    if windows == "few tokens":
        monkeypatch.setattr(sampling_draws, "WINDOW_MAX_TOKENS", 3)

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
    from conveyor.runner.sampling_draws import draw_truncated

    n, vocab = 2000, 300
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(9))
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    batch = weights.repeat_interleave(n, dim=0)  # rows 0..n-1: top-k 2; rows n..2n-1: no truncation
    draws = draw_truncated(batch, [2] * n + [0] * n, [1.0] * (2 * n), torch.cat([stratified(n), stratified(n)]))
    top2 = set(logits[0].topk(2).indices.tolist())
    assert set(draws[:n].tolist()) <= top2
    freq = torch.bincount(draws[n:], minlength=vocab).double() / n
    torch.testing.assert_close(freq, logits[1].softmax(dim=-1).double(), atol=2.0 / n, rtol=0)
