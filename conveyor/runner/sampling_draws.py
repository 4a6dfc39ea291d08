"""The inverse-CDF draws: one token per row from unnormalised weights and one uniform per row.

No sort of the vocabulary and no per-entry noise (torch's CPU sort of [100, 49152] takes ~300 ms, ten decode
steps; an exponential race needs a random number per entry): ``draw_tokens`` for whole rows, ``draw_truncated``
for top-k / top-p nuclei (vLLM's semantics), ``draw_top_p_flat`` for nuclei too wide for a window. The sampler
(``runner.sampler``) decides which rows take which draw.
"""

from __future__ import annotations

import math

import torch

CDF_BLOCK = 256  # vocabulary entries per block of draw_tokens' first level
TRUNCATION_WINDOWS = (8.0, 16.0)  # draw_truncated looks for the kept tokens this far (in nats) below the top one
WINDOW_MAX_TOKENS = 4096  # and sorts at most this many tokens of a row there
DIRECT_TOP_K = 256  # rows with a top-k up to this take torch.topk straight away (cheaper than a window pass)


def draw_tokens(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``weights`` [R, V] (unnormalised probabilities: >= 0, a positive one per row),
    drawn by inverse CDF with ``u`` [R, 1] (float64 in [0, 1)): the first index whose cumulative weight exceeds
    u * total. Two levels, so no pass over the vocabulary is a sequential scan: the cumulative sums of blocks of
    CDF_BLOCK weights pick a block, then the cumulative sum inside that one block picks the token (about 2 ms for
    [100, 49152] where a full-row cumsum takes 5, in float64 22). Never a token of weight 0: past the target, the
    first index where a cumulative sum grows has a positive weight, and a target rounded onto an edge steps back
    to the last positive weight before it."""
    rows, vocab = weights.shape
    blocks = _cdf_blocks(weights)
    num_blocks = blocks.shape[1]
    block_cdf = blocks.sum(dim=-1).double().cumsum_(dim=-1)  # [R, num_blocks]
    target = u * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=num_blocks - 1)
    before = torch.nn.functional.pad(block_cdf, (1, 0)).gather(1, block)  # the mass of the blocks before it
    inner = blocks.gather(1, block.unsqueeze(-1).expand(rows, 1, CDF_BLOCK)).squeeze(1).double().cumsum_(dim=-1)
    offset = torch.searchsorted(inner, target - before, right=True).clamp_(max=CDF_BLOCK - 1)
    tokens = (block * CDF_BLOCK + offset).clamp_(max=vocab - 1)
    for r in (weights.gather(1, tokens) == 0).nonzero()[:, 0].tolist():  # rounding only: rare
        positive = (weights[r, :int(tokens[r]) + 1] > 0).nonzero()
        tokens[r] = positive[-1] if len(positive) else (weights[r] > 0).nonzero()[0]
    return tokens.squeeze(1)


def _cdf_blocks(weights: torch.Tensor) -> torch.Tensor:
    """``weights`` [R, V] as [R, ceil(V / CDF_BLOCK), CDF_BLOCK]: a view, or a zero-padded copy when CDF_BLOCK
    does not divide V."""
    rows, vocab = weights.shape
    num_blocks = -(-vocab // CDF_BLOCK)
    padded = weights if num_blocks * CDF_BLOCK == vocab else \
        torch.nn.functional.pad(weights, (0, num_blocks * CDF_BLOCK - vocab))
    return padded.view(rows, num_blocks, CDF_BLOCK)


def draw_truncated(weights: torch.Tensor, top_ks: list[int], top_ps: list[float], u: torch.Tensor) -> torch.Tensor:
    """As draw_tokens, from each row's top-k (0: off) then top-p (1.0: off) nucleus, vLLM's semantics: top-k's
    tokens renormalised, then the most likely tokens whose mass before them is below top_p (at least one).

    Without a sort of the vocabulary where it can (torch's CPU sort of [100, 49152] takes ~300 ms, ten decode
    steps): a row with a top-k up to DIRECT_TOP_K takes its top-k from torch.topk (its nucleus lies inside);
    for the others the kept tokens are looked for among those within a window below the row's top weight, found through
    the blocks of CDF_BLOCK whose largest weight reaches into it, and sorted there alone. A window settles a row
    when the row's top-k lies inside it, or (no top-k) when it holds top_p of the row's mass. Rows no window
    settles, or whose window holds more than WINDOW_MAX_TOKENS tokens (flat distributions), take torch's exact
    top-k, or with top-p alone draw_top_p_flat."""
    rows, vocab = weights.shape
    dev = weights.device
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=dev)
    ps = torch.tensor(top_ps, dtype=torch.float64, device=dev)
    full_mass = weights.sum(dim=-1).double()  # (a float64 reduction over [100, 49152] takes 30x longer here)
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    untruncated = (ks == vocab) & (ps >= 1.0)  # rows that sample the whole vocabulary, batched with others
    if untruncated.any():
        tokens[untruncated] = draw_tokens(weights[untruncated], u[untruncated])
    direct = ks <= DIRECT_TOP_K  # a small top-k: torch.topk costs less than a window's pass
    pending = (~direct & ~untruncated).nonzero()[:, 0]
    wide = [direct.nonzero()[:, 0]]
    if len(pending):
        blocks = _cdf_blocks(weights)
        block_max = blocks.amax(dim=-1)
    for window in TRUNCATION_WINDOWS if len(pending) else ():
        threshold = math.exp(-window)
        counts = (weights >= threshold).sum(dim=-1, dtype=torch.int32)[pending].long()
        narrow = counts <= WINDOW_MAX_TOKENS  # a flat row's thousands of tokens are not gathered
        block_row, block = ((block_max[pending] >= threshold) & narrow.unsqueeze(1)).nonzero(as_tuple=True)
        cand = blocks[pending[block_row], block]  # [S, CDF_BLOCK]: the blocks that reach into the window
        entry, offset = (cand >= threshold).nonzero(as_tuple=True)
        row, col, vals = block_row[entry], block[entry] * CDF_BLOCK + offset, cand[entry, offset].double()
        k, p = ks[pending], ps[pending]
        window_mass = torch.zeros(len(pending), dtype=torch.float64, device=dev).index_add_(0, row, vals)
        settled = narrow & ((counts >= k) | ((k == vocab) & (window_mass >= p * full_mass[pending])))
        if settled.any():
            keep = settled[row]
            tokens[pending[settled]] = _draw_from_candidates(row[keep], col[keep], vals[keep], k, p,
                                                             full_mass[pending], u[pending], settled, vocab)
        wide.append(pending[~narrow])  # a wider window holds more: straight to the exact path
        pending = pending[~settled & narrow]
        if not len(pending):
            break
    pending = torch.cat([pending, *wide])
    if not len(pending):
        return tokens
    # exact for the rest: the top-k by torch.topk; top-p alone (a flat row) by mass buckets
    k = ks[pending]
    group = pending[k < vocab]
    if len(group):
        vals, cols = weights[group].topk(int(ks[group].max()), dim=-1)  # sorted, largest first
        row = torch.arange(len(group), device=dev).unsqueeze(1).expand_as(cols).reshape(-1)
        tokens[group] = _draw_from_candidates(row, cols.reshape(-1), vals.reshape(-1).double(), ks[group], ps[group],
                                              full_mass[group], u[group],
                                              torch.ones(len(group), dtype=torch.bool, device=dev), vocab,
                                              presorted=True)
    group = pending[k == vocab]
    if len(group):
        if len(group) == rows:  # every row (in any order): no copy of the weights ([100, 49152]: ~7 ms)
            return draw_top_p_flat(weights, ps, full_mass, u)
        tokens[group] = draw_top_p_flat(weights[group], ps[group], full_mass[group], u[group])
    return tokens


NAT_BUCKETS = 64  # draw_top_p_flat's buckets per nat below the top weight
NUM_BUCKETS = 2048  # (32 nats; weights further down, and zeros, share the last bucket)


def draw_top_p_flat(w: torch.Tensor, ps: torch.Tensor, mass: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Top-p for rows whose nucleus is a large part of the vocabulary (no window held it), without sorting the
    row: the weights' masses are summed in buckets of 1/NAT_BUCKETS nat below the row's top weight (bucket order
    is weight order), the bucket where the cumulative mass reaches top_p is the only one whose tokens are sorted,
    every token in the buckets above it is kept and every one below is dropped. (torch's sort of [100, 49152]
    takes ~300 ms.)"""
    rows, vocab = w.shape
    dev = w.device
    bucket = torch.log(w).mul_(-NAT_BUCKETS).clamp_(max=NUM_BUCKETS - 1).to(torch.int32)  # w = 0: the last
    key = (bucket + (torch.arange(rows, dtype=torch.int32, device=dev) * NUM_BUCKETS).unsqueeze(1)).view(-1)
    bucket_mass = torch.bincount(key, weights=w.view(-1), minlength=rows * NUM_BUCKETS).view(rows, NUM_BUCKETS)
    cum = bucket_mass.double().cumsum_(dim=-1)
    limit = (ps * mass).unsqueeze(1)
    edge = torch.searchsorted(cum, limit).clamp_(max=NUM_BUCKETS - 1)  # first bucket whose cumulative mass reaches it
    before_edge = torch.nn.functional.pad(cum, (1, 0)).gather(1, edge)  # the mass of the buckets above the edge
    edge = edge.to(torch.int32)  # (comparing int32 buckets with int64 would copy them all)
    kept = w.masked_fill(bucket >= edge, 0.0)
    row, col = (bucket == edge).nonzero(as_tuple=True)  # the edge bucket's tokens: ordered exactly
    row, col, vals, starts, _ = _by_row_largest_first(row, col, w[row, col].double(), rows)
    keep = before_edge.squeeze(1)[row] + _weight_before(vals, row, starts) < limit.squeeze(1)[row]
    kept[row[keep], col[keep]] = w[row[keep], col[keep]]
    return draw_tokens(kept, u)


def _draw_from_candidates(row, col, vals, ks, ps, full_mass, u, settled, vocab, presorted=False) -> torch.Tensor:
    """The draw of draw_truncated for the ``settled`` rows, given candidate entries (row, col, weight) that
    hold each such row's top-k (or its whole nucleus); ``presorted``: already by row, largest weight first.
    Returns one token per settled row, in row order."""
    dev = vals.device
    num_rows = len(settled)
    row, col, vals, starts, counts = _by_row_largest_first(row, col, vals, num_rows, presorted)
    rank = torch.arange(len(row), device=dev) - starts[row]
    vals = vals * (rank < ks[row])  # top-k
    k_mass = torch.zeros(num_rows, dtype=torch.float64, device=dev).index_add_(0, row, vals)
    norm = torch.where(ks < vocab, k_mass, full_mass)  # top-k renormalises over its own tokens
    # top-p (the first entry is always kept: nothing before it)
    vals = vals * (_weight_before(vals, row, starts) < ps[row] * norm[row])
    cum = vals.cumsum(0)
    row_start = torch.nn.functional.pad(cum, (1, 0))[starts]
    kept_mass = torch.zeros(num_rows, dtype=torch.float64, device=dev).index_add_(0, row, vals)
    target = row_start + u.squeeze(1) * kept_mass
    ends = starts + counts - 1
    pos = torch.minimum(torch.searchsorted(cum, target[settled], right=True), ends[settled])
    for i in (vals[pos] == 0).nonzero()[:, 0].tolist():  # a target rounded onto the row's end: rare
        j = int(pos[i])
        while vals[j] == 0:
            j -= 1
        pos[i] = j
    return col[pos]


def _by_row_largest_first(row, col, vals, num_rows, presorted=False):
    """Entries (row, col, weight <= 1) ordered by row, then largest weight first (``presorted``: already so);
    returns them with each row's first position and count."""
    if not presorted:
        order = (row.double() * 2 + (1.0 - vals)).argsort()  # one sort: rows apart by 2, weights within 1
        row, col, vals = row[order], col[order], vals[order]
    counts = torch.bincount(row, minlength=num_rows)
    return row, col, vals, counts.cumsum(0) - counts, counts


def _weight_before(vals: torch.Tensor, row: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """For entries ordered as _by_row_largest_first leaves them: the weight of the same row's entries before each."""
    cum = vals.cumsum(0)
    return cum - vals - torch.nn.functional.pad(cum, (1, 0))[starts][row]
