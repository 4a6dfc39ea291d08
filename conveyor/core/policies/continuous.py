"""Continuous batching, the product: a request joins as soon as a slot and blocks are free, and leaves the moment
it finishes. Orca-style (whole prompt in the step it joins), or chunked under a token budget."""

from __future__ import annotations

from conveyor.core.policies.base import BasePolicy


class ContinuousPolicy(BasePolicy):
    """Orca-style iteration-level batching: a request joins as soon as a slot and blocks are free, and its
    whole prompt is computed in the step it joins (``BasePolicy``'s decisions, unchanged)."""

    name = "continuous"


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
