"""Verification of proposed tokens (``runner.spec_verify``): greedy keeps exactly the argmax-matching run;
sampled requests get rejection sampling, checked against the exact target distributions by chi-square."""

from __future__ import annotations

from collections import Counter

import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.runner.input_batch import RequestState, SpecRows
from conveyor.runner.sampler import Sampler
from conveyor.runner.spec_verify import verify_proposals
from tests.helpers.stats import chi2_critical

V = 6


def state(i: int, **params) -> RequestState:
    return RequestState(f"r{i}", [1, 2, 3], 3, SamplingParams(**params), 3, i, 0, None)


def test_greedy_keeps_the_argmax_matching_run_then_the_argmax():
    logits = torch.full((3 * 3, V), -5.0)
    argmax = [4, 1, 3, 4, 0, 5, 2, 2, 2]
    logits[torch.arange(9), argmax] = 5.0
    spec = [SpecRows(state(0, temperature=0.0), [4, 1]),  # both match: then the bonus token 3
            SpecRows(state(1, temperature=0.0), [4, 5]),  # the second misses: 4, then the argmax 0
            SpecRows(state(2, temperature=0.0), [0, 2])]  # the first misses
    assert verify_proposals(Sampler([9]), logits, spec) == [[4, 1, 3], [4, 0], [2]]


def test_sampled_outputs_have_the_target_distribution():
    """20,000 verifications of the proposal [d0, d1] at temperature 0.7 with top-k 4. The first token's
    distribution is the first row's target; given it equals d0, the second's is the second row's; given both
    matched, the third is drawn from the third row. Each is a chi-square goodness-of-fit test at p = 1e-4."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, V, generator=gen) * 1.5
    drafts = [int(rows[0].argsort()[-2]), int(rows[1].argmax())]  # a likely but not top first proposal
    params = dict(temperature=0.7, top_k=4)

    def target(row: torch.Tensor) -> torch.Tensor:
        scaled = row / params["temperature"]
        kept = scaled.topk(params["top_k"]).indices
        p = torch.zeros(V)
        p[kept] = torch.softmax(scaled[kept], dim=0)
        return p

    n = 20000
    spec = [SpecRows(state(i, **params), drafts) for i in range(n)]
    produced = verify_proposals(Sampler([9], seed=1), rows.repeat(n, 1), spec)
    assert all(1 <= len(t) <= 3 for t in produced)

    def check(tokens: list[int], p: torch.Tensor) -> None:
        counts = Counter(tokens)
        assert not set(counts) - set(torch.nonzero(p).flatten().tolist()), "a token outside the target's support"
        expected = p * len(tokens)
        cells = [(counts[t], float(expected[t])) for t in range(V) if expected[t] > 0]
        stat = sum((c - e) ** 2 / e for c, e in cells)
        assert stat < chi2_critical(len(cells) - 1), (stat, cells)

    check([t[0] for t in produced], target(rows[0]))
    second = [t[1] for t in produced if t[0] == drafts[0]]
    assert len(second) > 1000
    check(second, target(rows[1]))
    third = [t[2] for t in produced if t[:2] == drafts]
    assert len(third) > 300
    check(third, target(rows[2]))
