"""What one step of the engine core produces, before output processing: per request, the token it sampled.

This is the one form a token takes between the scheduler and the output processor, wherever the two live: in one
process (``LLMEngine.step`` hands it straight to its ``OutputProcessor``) or in two (the engine core process sends
it as a msgpack frame and the API process's ``OutputProcessor`` consumes it; ``engine.ipc``). It carries, besides
the token, the few request counters the output side reports (cached prompt tokens, preemptions, when first
scheduled), so the output side never reads the scheduler's ``Request`` objects.

Ids are the scheduler's (child) request ids: an ``n > 1`` request is ``n`` of them (``child_requests``).
"""

from __future__ import annotations

import msgspec

from conveyor.core.outputs import PromptLogprobs, TokenLogprobs
from conveyor.core.sampling_params import SamplingParams


class CoreOutput(msgspec.Struct, array_like=True, gc=False):
    """One (child) request's news from one step."""

    request_id: str
    new_token_id: int
    logprobs: TokenLogprobs | None
    finish_reason: str | None  # "stop" | "length" when this token finished it
    stop_reason: int | None  # the stop token id that finished it, if one did
    num_cached_tokens: int  # prompt tokens the prefix cache served at its first admission
    num_preemptions: int
    first_scheduled: float | None  # time.monotonic() of its first scheduling (the clock is system-wide)
    pooled: list[float] | None = None  # a pooling request's result (new_token_id is then -1)


class CoreStepOutput(msgspec.Struct, array_like=True, gc=False):
    """Everything one step produced for the output side. ``time``: when the step's tokens were sampled."""

    time: float
    outputs: list[CoreOutput] = []
    prompt_logprobs: dict[str, PromptLogprobs] = {}  # child id -> the prompt positions this step scored
    failed: dict[str, str] = {}  # child id -> why its per-request work failed in the executor

    def __bool__(self) -> bool:
        return bool(self.outputs or self.prompt_logprobs or self.failed)


def child_requests(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The scheduler requests behind one user request: itself for ``n == 1``, else ``n`` children with ids
    ``{i}_{request_id}`` and derived seeds. Both sides of the engine pipe compute the same list."""
    if params.n == 1:
        return [(request_id, params)]
    return [(f"{i}_{request_id}", params.for_child(i)) for i in range(params.n)]
