"""One step's token budget (the shape of mini-sglang's ``PrefillAdder``): how many tokens are left, and how much
of it a request gets. The scheduler spends it on running requests first, then on admissions."""

from __future__ import annotations

from conveyor.core.kv_eviction import KVEvictor
from conveyor.core.outputs import is_decode
from conveyor.core.policies.base import NO_YIELD, SchedulingPolicy, StepYield
from conveyor.core.request import Request


class TokenBudget:
    """Starts at the policy's ``step_budget()``; ``grant`` sizes a request's share, ``spend`` takes it.

    A share is also bounded by what the request may take this step: KV eviction's chunk cap (a prompt chunk that
    fits the request's KV budget), and what the policy's ``StepYield`` says: a running request's token cap, and
    for admissions of a worse priority than ``admit_cap``'s, at most its tokens in all."""

    def __init__(self, policy: SchedulingPolicy, whole_prompts: bool = False, evictor: KVEvictor | None = None,
                 yielded: StepYield = NO_YIELD) -> None:
        self.policy = policy
        self.left = policy.step_budget()
        self.whole_prompts = whole_prompts  # a bidirectional encoder's prompt runs all of it or nothing
        self.evictor = evictor
        self.caps = yielded.caps or {}
        self.admit_cap = yielded.admit_cap  # (priority, tokens still open to admissions of a worse priority)

    @property
    def exhausted(self) -> bool:
        return self.left <= 0

    def _capped(self, request: Request) -> bool:
        """Whether ``request`` is admitted under ``admit_cap``."""
        return self.admit_cap is not None and request.priority > self.admit_cap[0]

    def closed_to(self, request: Request) -> bool:
        """Whether admitting ``request`` may take no token this step (its priority's cap is spent)."""
        return self._capped(request) and self.admit_cap[1] <= 0

    def grant(self, request: Request, remaining: int, admitting: bool = False) -> int:
        """Tokens to compute now for ``request``, ``remaining`` tokens behind (0: none this step): a decode gets its
        one token, a prompt what the policy's chunking allows within what is left and what the request may take;
        a prompt that must run whole all of it or nothing."""
        if self.evictor is not None and (cap := self.evictor.chunk_cap(request)) is not None:
            remaining = min(remaining, cap)
        if admitting and self._capped(request):
            remaining = min(remaining, self.admit_cap[1])
        elif not admitting:
            remaining = min(remaining, self.caps.get(request.request_id, remaining))
        if self.whole_prompts:
            return remaining if remaining <= self.left else 0
        return 1 if is_decode(remaining) else self.policy.prefill_chunk(remaining, self.left)

    def spend(self, num_tokens: int, admitted: Request | None = None) -> None:
        """Take ``num_tokens`` (of an ``admitted`` request's, from its priority's cap too)."""
        self.left -= num_tokens
        if admitted is not None and self._capped(admitted):
            self.admit_cap = (self.admit_cap[0], self.admit_cap[1] - num_tokens)
