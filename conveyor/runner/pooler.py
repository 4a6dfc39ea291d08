"""Pooling: a prefill-only request's result from its prompt's hidden states (``core.pooling_params``).

Which rows (``PoolingConfig.pooling_type``): the mean of every prompt token's, the first token's ([CLS]) or the
last token's. A causal model's prompt may arrive in chunks over several steps: the mean is summed chunk by chunk
(in float32) and divided when the last chunk is in; the first row is kept from the first chunk. Then the head:

- embed: the pooled vector, cut to the request's ``dimensions`` (Matryoshka) and L2-normalised when asked, in
  float32, as sentence-transformers does (truncate, then normalise);
- score with a classifier (a cross-encoder): its logit through a sigmoid, as sentence-transformers' CrossEncoder
  and vLLM score one-label models;
- score with two tokens (a decoder reranker, ``classifier_from_token``): the LM head's logits of (no, yes) at the
  last token, softmax, the probability of "yes", as Qwen3-Reranker's model card computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from conveyor.core.pooling_params import PoolingParams
from conveyor.models.pooling_config import PoolingConfig


@dataclass
class PoolRows:
    """Rows [row, row + count) of a step's hidden states are prompt tokens [start, start + count) of a pooling
    request; ``last``: the step computes its last prompt token (its result is due)."""

    req_id: str
    params: PoolingParams
    row: int
    start: int
    count: int
    last: bool


class Pooler:
    """One model's pooling (module doc). ``classifier_token_ids``: a decoder reranker's (no, yes) token ids."""

    def __init__(self, model: torch.nn.Module, config: PoolingConfig,
                 classifier_token_ids: tuple[int, int] | None = None) -> None:
        self.model, self.config = model, config
        self.classifier_token_ids = classifier_token_ids
        self._partial: dict[str, list] = {}  # a chunked prompt's [sum of rows, count, first row]

    def forget(self, req_id: str) -> None:
        """Drop a request's partial sums (finished, aborted or preempted: it is recomputed from its start)."""
        self._partial.pop(req_id, None)

    def pool(self, hidden: torch.Tensor, rows: list[PoolRows]) -> dict[str, list[float]]:
        """The results of the requests whose last prompt token this step computed; partial sums of the others."""
        done: list[tuple[PoolRows, torch.Tensor]] = []
        for r in rows:
            pooled = self._pool_rows(hidden, r)
            if pooled is not None:
                done.append((r, pooled))
        if not done:
            return {}
        pooled = torch.stack([p for _, p in done])
        if self.config.task == "score":
            scores = self._score(pooled)
            return {r.req_id: [s] for (r, _), s in zip(done, scores.tolist())}
        return {r.req_id: self._embedding(p, r.params) for r, p in done}

    def _pool_rows(self, hidden: torch.Tensor, r: PoolRows) -> torch.Tensor | None:
        kind = self.config.pooling_type
        chunk = hidden[r.row:r.row + r.count]
        if kind == "last":
            return chunk[-1] if r.last else None
        if r.start == 0 and r.last:  # the whole prompt in this step (always, for a bidirectional encoder)
            return chunk[0] if kind == "cls" else chunk.float().mean(0)
        partial = self._partial.get(r.req_id)
        if partial is None:
            partial = self._partial[r.req_id] = [torch.zeros(chunk.shape[1], dtype=torch.float32,
                                                             device=chunk.device), 0, chunk[0]]
        partial[0] += chunk.float().sum(0)
        partial[1] += r.count
        if not r.last:
            return None
        del self._partial[r.req_id]
        return partial[2] if kind == "cls" else partial[0] / partial[1]

    def _score(self, pooled: torch.Tensor) -> torch.Tensor:
        if self.classifier_token_ids is not None:  # yes / no logits of the LM head at the last token
            logits = self.model.compute_logits(pooled.to(self._dtype()))[:, list(self.classifier_token_ids)]
            return torch.softmax(logits.float(), dim=-1)[:, 1]
        return torch.sigmoid(self.model.classify(pooled.to(self._dtype())).float()[:, 0])

    def _dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    def _embedding(self, pooled: torch.Tensor, params: PoolingParams) -> list[float]:
        vector = pooled.float()
        dims = params.dimensions or self.config.dimensions
        if dims is not None:
            vector = vector[:dims]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = F.normalize(vector, p=2, dim=0)
        return vector.tolist()
