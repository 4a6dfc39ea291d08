"""What one step of the engine core produces, before output processing: the scheduler's ``RequestUpdate``s.

The scheduler's own per-token object (``core.outputs.RequestUpdate``, a ``msgspec`` struct) is the one form a token
takes between the scheduler and the output processor, wherever the two live: in one process (``LLMEngine.step``
hands the step straight to its ``OutputProcessor``) or in two (the engine core process sends it as a msgpack
frame and the API process's ``OutputProcessor`` consumes it; ``engine.ipc``). An update carries, besides the
token, the few request counters the output side reports (cached prompt tokens, preemptions, when first
scheduled), so the output side never reads the scheduler's ``Request`` objects.

Ids are the scheduler's (child) request ids: an ``n > 1`` request is ``n`` of them (``child_requests``).
"""

from __future__ import annotations

import msgspec

from conveyor.core.outputs import PromptLogprobs, RequestUpdate
from conveyor.core.sampling_params import SamplingParams


class CoreStepOutput(msgspec.Struct, array_like=True, gc=False):
    """Everything one step produced for the output side. ``time``: when the step's tokens were sampled."""

    time: float
    outputs: list[RequestUpdate] = []
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
