"""Turns the logits of the sampling rows into one token each (plus logprobs where asked), vLLM semantics.

Order: the grammar bitmask of constrained rows (structured outputs: -inf where the grammar forbids a token) ->
raw logprobs (log_softmax of those logits, before anything below) -> allowed_token_ids, bad_words, logit_bias
(``logit_edits``) -> penalties (repetition over
prompt + output, presence / frequency over output) -> min_tokens (ban stop tokens) -> greedy argmax, or
temperature -> min-p -> top-k / top-p -> an inverse-CDF draw with one uniform per row (``sampling_draws``: no
sort of the vocabulary, no per-entry noise), the uniform from the request's own generator when seeded, so a
seeded request samples the same tokens whatever else is in the batch. Which rows take which treatment, and the
drawing rows' tensors, come decided in a ``SamplingMetadata`` (built by the input batch).
All results go to the host in ONE .tolist() per step. Stop conditions are the scheduler's business.
"""

from __future__ import annotations

import torch

from conveyor.core.outputs import TokenLogprobs
from conveyor.runner.input_batch import RequestState, SamplingMetadata
from conveyor.runner.logit_edits import apply_logit_edits
from conveyor.runner.sampling_draws import draw_tokens, draw_truncated
from conveyor.structured.manager import apply_bitmask


class Sampler:
    def __init__(self, eos_token_ids: list[int], device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)  # for unseeded requests

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata,
               constraint: tuple[list[int], torch.Tensor] | None = None,
               ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [R, V] (one row per request of ``meta.reqs``) -> (token ids, logprobs or None per request).
        ``constraint``: the rows of constrained requests and their grammar bitmask ([rows, ceil(V / 32)])."""
        reqs = meta.reqs
        if constraint is not None:  # in the logits' own dtype, so plain greedy rows keep the fast path below
            apply_bitmask(logits, *constraint)
        if meta.plain_greedy:
            # Plain greedy rows (the common case) need only the argmax, which reads the logits in their own
            # dtype: no float32 copy (for bfloat16 logits of 86 x 49152, 1.4 -> 0.7 ms).
            return argmax_rows(logits).tolist(), [None] * len(reqs)
        logits = logits.float()
        lp_rows = meta.logprob_rows
        raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None

        if meta.edited_rows:
            apply_logit_edits(logits, [reqs[i] for i in meta.edited_rows], meta.edited_rows)
        if meta.penalised_rows:
            apply_penalties(logits, [reqs[i] for i in meta.penalised_rows], meta.penalised_rows)
        vocab = logits.shape[1]
        for i in meta.below_min_tokens:
            ids = self._stop_ids(reqs[i], vocab)
            if ids:
                logits[i, ids] = float("-inf")

        random_rows = meta.random_rows
        if len(random_rows) == len(reqs):  # every row samples: draw in place (a copy of the logits is 20 MB)
            token_ids = self._sample_random(logits, meta)
        else:
            token_ids = argmax_rows(logits)
            if random_rows:
                token_ids[random_rows] = self._sample_random(logits[random_rows], meta)

        if raw_logprobs is None:
            return token_ids.tolist(), [None] * len(reqs)
        return self._with_logprobs(token_ids, raw_logprobs, lp_rows, [r.params for r in reqs])

    def _stop_ids(self, req: RequestState, vocab: int) -> list[int]:
        eos = [] if req.params.ignore_eos else self.eos_token_ids
        # Ids outside the vocabulary can never be sampled, so there is nothing to ban (and indexing would fail).
        return sorted(t for t in set(eos) | set(req.params.stop_token_ids) if 0 <= t < vocab)

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """One token per row of ``logits`` (the rows of ``meta.random_rows``, in that order)."""
        reqs = [meta.reqs[i] for i in meta.random_rows]
        dev = logits.device
        logits = logits.div_(meta.temperatures.unsqueeze(1))
        # One uniform per row (see sampling_draws.draw_tokens). An exponential race, argmax(p / E), needs a random
        # number per vocabulary entry: torch's CPU exponential_ alone took 27 ms for [32, 32000] here, as long as
        # the model's whole decode step at that batch (vLLM's CPU sampler fuses its noise into a kernel).
        u = torch.empty(len(reqs), 1, dtype=torch.float64, device=dev)
        unseeded = [i for i, r in enumerate(reqs) if r.generator is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), 1, dtype=torch.float64, device=dev, generator=self.generator)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                u[i] = torch.rand(1, dtype=torch.float64, device=dev, generator=r.generator)
        weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()  # in place; each row's largest is 1
        if meta.min_ps is not None:  # min-p: below min_p x the top token's probability, i.e. a weight below min_p
            weights.masked_fill_(weights < meta.min_ps.unsqueeze(1), 0.0)
        if meta.truncates:
            return draw_truncated(weights, meta.top_ks, meta.top_ps, u)
        return draw_tokens(weights, u)

    @staticmethod
    def _with_logprobs(token_ids, raw_logprobs, lp_rows, params):
        """Pack ids, sampled logprobs and top-N into one float64 tensor so one .tolist() fetches everything."""
        n, top_n = len(params), max(params[i].logprobs for i in lp_rows)
        sampled_lp = raw_logprobs.gather(1, token_ids[lp_rows].unsqueeze(1))
        top_vals, top_ids = raw_logprobs.topk(top_n, dim=-1)  # top_n == 0 gives empty columns
        per_row = torch.cat([sampled_lp.double(), top_ids.double(), top_vals.double()], dim=1)
        flat = torch.cat([token_ids.double(), per_row.flatten()]).tolist()
        ids = [int(x) for x in flat[:n]]
        width = 1 + 2 * top_n
        out: list[TokenLogprobs | None] = [None] * n
        for j, i in enumerate(lp_rows):
            row = flat[n + j * width: n + (j + 1) * width]
            k = params[i].logprobs
            top = [(int(t), v) for t, v in zip(row[1:1 + k], row[1 + top_n:1 + top_n + k])]
            out[i] = TokenLogprobs(token_id=ids[i], logprob=row[0], top=top)
        return ids, out


def prompt_logprobs(logits: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprobs]:
    """Logprobs of ``targets`` (one token per row of ``logits`` [R, V]) with their rank and the top ``top_n``:
    the raw model distribution (log_softmax), as vLLM's prompt_logprobs."""
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # float32 or 64
    target = torch.tensor(targets, device=lp.device).unsqueeze(1)
    own = lp.gather(1, target)
    rank = (lp > own).sum(dim=1, keepdim=True) + 1
    top_vals, top_ids = lp.topk(top_n, dim=-1)
    rows = torch.cat([own.double(), rank.double(), top_ids.double(), top_vals.double()], dim=1).tolist()
    return [TokenLogprobs(token_id=t, logprob=row[0], rank=int(row[1]),
                          top=[(int(i), v) for i, v in zip(row[2:2 + top_n], row[2 + top_n:])])
            for t, row in zip(targets, rows)]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum). On CPU the native kernel when it is built (it splits the rows over the
    threads: float32 [86, 32000] 0.25 ms against numpy's 0.49, 2 threads, Xeon with AVX-512; it reads bfloat16
    rows as they are), else numpy's SIMD argmax, ~7x faster than torch's (0.6 vs 4.3 ms for [100, 32000]),
    bfloat16 through a float32 copy (exact). Both take a NaN as the maximum, as numpy does."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
        return x.argmax(dim=-1)
    if x.stride(-1) == 1:
        from conveyor.kernels import load_cpu_kernels

        kernels = load_cpu_kernels()
        if kernels is not None:
            return kernels.argmax_rows(x)
    return torch.from_numpy(x.float().numpy().argmax(axis=-1))


def apply_penalties(logits: torch.Tensor, reqs: list[RequestState], rows: list[int]) -> None:
    """In place on logits[rows]: repetition over prompt + output, then frequency and presence over output."""
    vocab = logits.shape[1]
    device = logits.device
    for row, r in zip(rows, reqs):
        p = r.params
        prompt = torch.tensor(r.token_ids[:r.num_prompt_tokens], dtype=torch.int64, device=device)
        output = torch.tensor(r.token_ids[r.num_prompt_tokens:], dtype=torch.int64, device=device)
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)
        x = logits[row]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[prompt[prompt < vocab]] = True
            penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x.copy_(torch.where(seen, penalised, x))
        if p.frequency_penalty:
            x.sub_(p.frequency_penalty * counts)
        if p.presence_penalty:
            x.sub_(p.presence_penalty * (counts > 0).to(x.dtype))
