"""Verification of proposed tokens (speculative decoding's executor side; the scheduler side is
``core.speculative``).

A request verifying ``k`` proposals has ``k + 1`` logits rows: after its last token and after each proposal.
Each row's token is drawn as the request draws any token (``Sampler``: the argmax when greedy); the proposals
are kept while they equal the token drawn before them, and the first drawn token that differs (or the one after
the last proposal) ends the run. For a proposal that is a fixed token (n-gram lookup), this is rejection
sampling: the proposal is kept with the target's probability of it, and a differing draw is a draw from the
target without it, so every output token has the distribution that decoding one at a time gives it; for greedy
requests it gives the same tokens.
"""

from __future__ import annotations

import torch

from conveyor.runner.input_batch import SamplingMetadata, SpecRows
from conveyor.runner.sampler import Sampler


def verify_proposals(sampler: Sampler, logits: torch.Tensor, spec: list[SpecRows]) -> list[list[int]]:
    """``logits``: the rows of the requests in ``spec``, in order, ``1 + len(drafts)`` each. Returns, per
    request, the tokens it produced: the accepted proposals, then one drawn token."""
    reqs = [s.state for s in spec for _ in range(len(s.drafts) + 1)]
    drawn, _ = sampler.sample(logits, SamplingMetadata.build(reqs, logits.device))
    produced, row = [], 0
    for s in spec:
        tokens, row = drawn[row:row + len(s.drafts) + 1], row + len(s.drafts) + 1
        accepted = 0
        while accepted < len(s.drafts) and s.drafts[accepted] == tokens[accepted]:
            accepted += 1
        produced.append(tokens[:accepted + 1])
    return produced
