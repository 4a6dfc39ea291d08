"""allowed_token_ids, bad_words and logit_bias: one pass over the rows that ask for any of them (vLLM's order and
semantics), in place on float32 logits, after the raw logprobs are taken."""

from __future__ import annotations

import torch

from conveyor.runner.input_batch import RequestState


def apply_logit_edits(logits: torch.Tensor, reqs: list[RequestState], rows: list[int]) -> None:
    """For each request in ``reqs`` (row ``rows[i]`` of ``logits``): every token outside allowed_token_ids gets
    -inf; so does the last token of each bad word whose other tokens end the output so far (a one-token word is
    always banned); then logit_bias is added."""
    vocab = logits.shape[1]
    device = logits.device
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    for row, r in zip(rows, reqs):
        p = r.params
        if p.allowed_token_ids:
            keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.int64, device=device)
            kept = logits[row, keep].clone()
            logits[row].fill_(float("-inf"))
            logits[row, keep] = kept
        if p.bad_words_token_ids:
            output = r.token_ids[r.num_prompt_tokens:]
            for word in p.bad_words_token_ids:
                *prefix, last = word
                if last < vocab and (not prefix or output[len(output) - len(prefix):] == prefix):
                    ban_rows.append(row)
                    ban_cols.append(last)
        if p.logit_bias:
            for token, bias in p.logit_bias.items():
                if token < vocab:
                    bias_rows.append(row)
                    bias_cols.append(token)
                    bias_vals.append(bias)
    if ban_rows:
        logits[ban_rows, ban_cols] = float("-inf")
    if bias_rows:
        index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_cols, device=device))
        logits.index_put_(index, torch.tensor(bias_vals, dtype=logits.dtype, device=device), accumulate=True)
