"""Continuous batching, the product: a request joins as soon as a slot and blocks are free, and leaves the moment
it finishes. Orca-style (whole prompt in the step it joins), or chunked under a token budget."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.core.config import SchedulerConfig
from conveyor.core.outputs import SchedulerOutput
from conveyor.core.policies.base import NO_WASTE, OnFinish, WastedWork
from conveyor.core.request import Request


class ContinuousPolicy:
    """Orca-style iteration-level batching: a request joins as soon as a slot and blocks are free, and its
    whole prompt is computed in the step it joins."""

    name = "continuous"

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def step_budget(self) -> int:
        # A whole prompt must always fit, so the budget is at least the model's context.
        return max(self.config.max_num_batched_tokens, self.config.max_model_len or 0)

    def prefill_chunk(self, remaining: int, budget: int) -> int:
        return remaining if remaining <= budget else 0

    def begin_step(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> list[Request]:
        return []

    def admits(self, request: Request) -> bool:
        return True

    def end_step(self, out: SchedulerOutput, running: Sequence[Request]) -> WastedWork:
        return NO_WASTE

    def on_finished(self, request: Request) -> OnFinish:
        return OnFinish.RETIRE

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        """FCFS: the most recently admitted request loses its blocks first."""
        return candidates[-1]


class ChunkedPolicy(ContinuousPolicy):
    """Continuous batching under a token budget: decodes first, then prompt chunks fill what is left
    (stall-free: a long prompt never stops running requests from decoding)."""

    name = "chunked"

    def step_budget(self) -> int:
        return self.config.max_num_batched_tokens

    def prefill_chunk(self, remaining: int, budget: int) -> int:
        chunk = min(remaining, budget)
        if self.config.long_prefill_token_threshold:
            chunk = min(chunk, self.config.long_prefill_token_threshold)
        return chunk
