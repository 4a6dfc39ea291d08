"""Scheduling policies: the decisions, separate from the mechanism (KV manager, token budget) in scheduler.py.

A policy answers four questions the scheduler asks every step:

- ``step_budget``: how many tokens this step may compute;
- ``prefill_chunk``: how many of a prompt's remaining tokens to compute now (0: not this step);
- ``may_admit``: may waiting requests join now (batch formation for the static/dynamic baselines);
- ``choose_victim``: which running request to preempt when blocks run out.

Slot-holding baselines (static, dynamic) also use ``begin_step`` / ``end_step`` (release a drained batch, pad
its prompts) and ``park_finished`` (a finished request keeps its slot as an idle slot).
"""

from __future__ import annotations

from conveyor.core.config import SchedulerConfig
from conveyor.core.request import Request


class ContinuousPolicy:
    """Orca-style iteration-level batching: a request joins as soon as a slot and blocks are free, and its
    whole prompt is computed in the step it joins."""

    name = "continuous"
    holds_finished_slots = False  # static batching keeps a finished request's slot busy until the batch drains

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def step_budget(self) -> int:
        # A whole prompt must always fit, so the budget is at least the model's context.
        return max(self.config.max_num_batched_tokens, self.config.max_model_len or 0)

    def prefill_chunk(self, remaining: int, budget: int) -> int:
        return remaining if remaining <= budget else 0

    def may_admit(self, waiting: list[Request], running: list[Request], now: float) -> bool:
        return True

    def choose_victim(self, candidates: list[Request]) -> Request:
        """FCFS: the most recently admitted request loses its blocks first."""
        return candidates[-1]

    def begin_step(self, scheduler, now: float) -> None:
        """Called first in every ``schedule``; batch policies release a drained batch's slots here."""

    def end_step(self, scheduler, out) -> None:
        """Called last in every ``schedule``; batch policies set ``out.num_padding_tokens`` here."""


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


def make_policy(config: SchedulerConfig):
    """The policy object named by ``config.policy``."""
    if config.policy == "chunked":
        return ChunkedPolicy(config)
    if config.policy == "continuous":
        return ContinuousPolicy(config)
    from conveyor.core.batch_policies import make_batch_policy  # static / dynamic baselines

    return make_batch_policy(config)
