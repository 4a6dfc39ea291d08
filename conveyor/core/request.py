"""A request as the scheduler sees it: token counts, no phases.

``num_computed_tokens`` catches up with ``num_tokens`` (prompt + output) one scheduled step at a time. A request
is "prefilling" exactly when it is more than one token behind; nothing stores that as a phase. Times are passed
in by the caller (core never reads the clock).

Life of a request::

    WAITING -> RUNNING <-> PREEMPTED (recompute: back to the queue head)
                  |
                  +--> PARKED (static/dynamic batching: finished for its user, slot held) --+
                  |                                                                         v
                  +-----------------------------------------------------------> FINISHED_{STOPPED,LENGTH,ABORTED}

``finish_reason`` is what the user sees ("stop", "length", "abort"); it is set the moment the request finishes
for its user, which for a parked request is before its status becomes FINISHED_*.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from conveyor.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after a recompute preemption
    PARKED = "parked"  # finished for its user; a static batch keeps its slot computing until the batch drains
    FINISHED_STOPPED = "stop"  # EOS, a stop token id, or (set by the engine) a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # aborted by the caller (client gone, shutdown)

    @property
    def is_pooling(self) -> bool:
        """A prefill-only request (embedding, scoring): it finishes when its prompt is computed."""
        return self.sampling_params.pooling is not None

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def holds_slot(self) -> bool:
        """Whether a request in this status is in the running batch (and holds KV blocks)."""
        return self in _HOLDS_SLOT

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason ("stop", "length", "abort") of a FINISHED_* status, else None."""
        return self.value if self.is_finished else None


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
_HOLDS_SLOT = {RequestStatus.RUNNING, RequestStatus.PARKED}

# max_tokens=None with no max_model_len: the request runs until a stop condition. A bound that no real
# generation reaches keeps the arithmetic in integers.
UNLIMITED_TOKENS = 1 << 30


class StopDecision(NamedTuple):
    """Why appending a token ends a request: its finished status and, for a stop token id, that id."""

    status: RequestStatus
    stop_reason: int | None = None


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
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished for its user
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at the first admission
    times: RequestTimes = field(default_factory=RequestTimes)
    # Block hashes of this request's full blocks, computed lazily by the KV manager (prefix caching).
    block_hashes: list[bytes] = field(default_factory=list)
    # KV eviction (core.kv_eviction): tokens whose KV blocks were given back. Positions stay the original ones;
    # the request's KV slots are its positions minus this (0 unless evicted from; reset when its KV is freed).
    num_evicted_tokens: int = 0

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
    def is_pooling(self) -> bool:
        """A prefill-only request (embedding, scoring): it finishes when its prompt is computed."""
        return self.sampling_params.pooling is not None

    @property
    def priority(self) -> int:
        """Lower is served first (``--scheduling-policy priority``); ties by arrival."""
        return self.sampling_params.priority

    @property
    def is_finished(self) -> bool:
        """Finished for its user (a parked request is, although it still holds its slot)."""
        return self.finish_reason is not None

    def max_output_tokens(self) -> int:
        """How many tokens this request may generate: max_tokens, capped by the room left in max_model_len."""
        room = None if self.max_model_len is None else self.max_model_len - self.num_prompt_tokens
        limit = self.sampling_params.max_tokens
        if limit is None:
            return room if room is not None else UNLIMITED_TOKENS
        return limit if room is None else min(limit, room)

    def append_token(self, token_id: int) -> bool:
        """Append a sampled token; True when it is output for the user.

        A parked request's token was computed for real and is nobody's output: it still extends the token list,
        so the KV bookkeeping (block count, block hashes) matches what the executor wrote, until the slot reaches
        ``max_model_len``, where it stops computing (as a padded batch's row would) but stays held.
        """
        if self.status is RequestStatus.RUNNING:
            self.output_token_ids.append(token_id)
            return True
        if self.max_model_len is None or self.num_tokens < self.max_model_len:
            self.output_token_ids.append(token_id)
        return False

    def stop_decision(self, token_id: int) -> StopDecision | None:
        """Whether the just-appended ``token_id`` ends the request (and why), or None to go on. Changes nothing."""
        params = self.sampling_params
        n_out = self.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return StopDecision(RequestStatus.FINISHED_STOPPED)
            if token_id in params.stop_token_ids:
                return StopDecision(RequestStatus.FINISHED_STOPPED, token_id)
        if n_out >= self.max_output_tokens():
            return StopDecision(RequestStatus.FINISHED_LENGTH)
        return None

    def mark_finished(self, status: RequestStatus, now: float) -> None:
        """The request is finished for its user from ``now`` on (it may still hold a parked slot)."""
        self.finish_reason = status.finish_reason
        self.times.finished = now
