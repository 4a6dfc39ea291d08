"""What a prefill-only request asks for: a pooled result of its prompt instead of generated tokens.

A request whose ``SamplingParams.pooling`` is set is an embedding or scoring request. The scheduler computes its
prompt (in chunks where the model's attention is causal, whole where it is bidirectional), the runner pools the
prompt's hidden states as the model's ``PoolingConfig`` says, and the request finishes in the step that computes
its last prompt token, freeing everything: it never decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "score")


@dataclass
class PoolingParams:
    """``task``: "embed" (a vector) or "score" (a relevance score of a (query, document) pair); ``normalize``: L2
    the embedding (None: as the model's config says); ``dimensions``: cut the embedding to this many leading
    values before normalising (Matryoshka; None: the model's default); ``pair_start``: where a pair's second
    segment starts in the prompt (token type 1 from there on, for a cross-encoder; None: one segment)."""

    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    pair_start: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
