"""What the engine returns to users, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from conveyor.core.outputs import TokenLogprobs


@dataclass
class CompletionOutput:
    """One completion of a prompt (there are ``n``). Text and token ids are cumulative."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each token was produced (monotonic s)
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic()`` seconds) and counts for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request (all ``n`` completions) after a step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = False
    # with SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Set when the engine could not process this request (a per-request failure it survived); the request is
    # then finished, its completions with finish_reason "abort".
    error: str | None = None
    # A prefill-only request's last output (``LLMEngine.add_prefill_request``): its first token is in
    # ``outputs``, and this ``engine.kv_handoff.KVHandoff`` continues it on a decode engine.
    kv_handoff: Any = None
    # A pooling request's result (SamplingParams.pooling): its embedding, or [score]; ``outputs`` hold no tokens
    pooled: list[float] | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def snapshot(out: RequestOutput) -> RequestOutput:
    """A copy whose lists the owner may go on appending to while a reader holds it (a stream's consumer reads an
    output at its own pace, while the output processor goes on)."""
    outputs = [
        replace(c, token_ids=list(c.token_ids), token_times=list(c.token_times),
                logprobs=None if c.logprobs is None else list(c.logprobs))
        for c in out.outputs
    ]
    return replace(out, outputs=outputs, metrics=replace(out.metrics))


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """One embedding or score, as vLLM's ``EmbeddingRequestOutput`` / ``ScoringRequestOutput``:
    ``out.outputs.embedding`` or ``out.outputs.score``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ScoringOutput
    finished: bool = True

