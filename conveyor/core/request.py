"""A request as the scheduler sees it: token counts, no phases.

``num_computed_tokens`` catches up with ``num_tokens`` (prompt + output) one scheduled step at a time. A request
is "prefilling" exactly when it is more than one token behind; nothing stores that as a phase. Times are passed
in by the caller (core never reads the clock).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conveyor.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after a recompute preemption
    FINISHED_STOPPED = "stop"  # EOS, a stop token id, or (set by the engine) a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # aborted by the caller (client gone, shutdown)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason ("stop", "length", "abort"), None while unfinished."""
        return self.value if self.is_finished else None


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}


@dataclass
class RequestTimes:
    """Timestamps (seconds, caller's clock) that the metrics are computed from."""

    arrival: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    """One sequence to complete. ``n > 1`` requests are split into one ``Request`` per completion by the engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None
    arrival_time: float = 0.0
    # Allow prefix-cache lookups for this request even when prefix caching is off globally: the siblings of an
    # n > 1 request share their prompt's blocks this way.
    share_prefix: bool = False

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at the first admission
    times: RequestTimes = field(default_factory=RequestTimes)
    # Static batching keeps a finished request's slot decoding until its batch drains ("idle slot").
    idle_slot: bool = False
    # Block hashes of this request's full blocks, computed lazily by the KV manager (prefix caching).
    block_hashes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.times.arrival = self.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def max_output_tokens(self) -> int:
        """How many tokens this request may generate: max_tokens, capped by the room left in max_model_len."""
        room = None if self.max_model_len is None else self.max_model_len - self.num_prompt_tokens
        limit = self.sampling_params.max_tokens
        if limit is None:
            return room if room is not None else 1 << 30
        return limit if room is None else min(limit, room)

    def check_stop(self, token_id: int) -> RequestStatus | None:
        """The finished status that appending ``token_id`` (already appended) causes, or None to go on."""
        params = self.sampling_params
        n_out = self.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_output_tokens():
            return RequestStatus.FINISHED_LENGTH
        return None
