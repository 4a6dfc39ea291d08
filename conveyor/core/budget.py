"""One step's token budget (the shape of mini-sglang's ``PrefillAdder``): how many tokens are left, and how much
of it a request gets. The scheduler spends it on running requests first, then on admissions."""

from __future__ import annotations

from conveyor.core.outputs import is_decode
from conveyor.core.policies.base import SchedulingPolicy


class TokenBudget:
    """Starts at the policy's ``step_budget()``; ``grant`` sizes a request's share, ``spend`` takes it."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self.left = policy.step_budget()

    @property
    def exhausted(self) -> bool:
        return self.left <= 0

    def grant(self, remaining: int, whole: bool = False) -> int:
        """Tokens to compute now for a request ``remaining`` tokens behind (0: none this step): a decode gets its
        one token, a prompt what the policy's chunking allows within what is left; a prompt that must run
        ``whole`` (a bidirectional encoder's) all of it or nothing."""
        if whole:
            return remaining if remaining <= self.left else 0
        return 1 if is_decode(remaining) else self.policy.prefill_chunk(remaining, self.left)

    def spend(self, num_tokens: int) -> None:
        self.left -= num_tokens
