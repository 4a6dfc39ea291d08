"""What the engine returns to users, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``.

A request's ``SamplingParams.output_kind`` says what each of its outputs holds: everything so far (``CUMULATIVE``,
the default) or only what is new since its previous output (``DELTA``, what streams ask for; a stream that falls
behind hands its reader the deltas it holds joined into one, ``RequestOutput.merged_with``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.core.outputs import TokenLogprobs


@dataclass
class CompletionOutput:
    """One completion of a prompt (there are ``n``): its text and tokens from character ``text_start`` and token
    ``token_start`` on (both 0 in a cumulative output; in a delta, what earlier outputs held)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids
    cumulative_logprob: float | None = None  # of every token so far, whatever the output's kind
    token_times: list[float] = field(default_factory=list)  # when each token was produced (monotonic s)
    num_preemptions: int = 0
    text_start: int = 0
    token_start: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Tokens this completion has generated so far, this output's included."""
        return self.token_start + len(self.token_ids)

    def followed_by(self, newer: CompletionOutput) -> CompletionOutput:
        """This delta and the next one of the same completion, as one delta (neither is changed)."""
        logprobs = None if self.logprobs is None else self.logprobs + (newer.logprobs or [])
        return CompletionOutput(self.index, self.text + newer.text, self.token_ids + newer.token_ids,
                                newer.finish_reason, newer.stop_reason, logprobs, newer.cumulative_logprob,
                                self.token_times + newer.token_times, newer.num_preemptions, self.text_start,
                                self.token_start)


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
    """The state of one request (all ``n`` completions) after a step; with ``delta``, only what changed since its
    previous output: the completions that did, each with its new text, tokens, logprobs and times."""

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
    delta: bool = False  # SamplingParams.output_kind DELTA: only what is new since the previous output

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated so far by the completions this output holds (a delta may leave some out)."""
        return sum(c.num_tokens for c in self.outputs)

    def merged_with(self, newer: RequestOutput) -> RequestOutput:
        """This output and the request's next one as one: the newer one, or, for deltas, the two deltas joined
        completion by completion (neither is changed)."""
        if not newer.delta:
            return newer
        joined = {c.index: c for c in self.outputs}
        for c in newer.outputs:
            joined[c.index] = joined[c.index].followed_by(c) if c.index in joined else c
        return RequestOutput(newer.request_id, newer.prompt, newer.prompt_token_ids,
                             sorted(joined.values(), key=lambda c: c.index), newer.metrics, newer.finished,
                             newer.prompt_logprobs, newer.error, newer.kv_handoff, newer.pooled, delta=True)


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
