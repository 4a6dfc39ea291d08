"""Hand-built steps: drive an executor with chosen chunks, no scheduler involved (the step benchmark, tests).

``StepBuilder`` owns block allocation for its requests, tracks each one's tokens and computed count, and builds
the ``SchedulerOutput`` deltas the real scheduler would send (a request whole the first time, then as deltas).
PURE PYTHON, like ``core``.
"""

from __future__ import annotations

import random

from conveyor.core.block_pool import cdiv
from conveyor.core.interfaces import Executor
from conveyor.core.outputs import CachedRequestData, ModelOutput, NewRequestData, SchedulerOutput
from conveyor.core.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4096)


class StepBuilder:
    """Requests added by hand, stepped by hand. Block ids are handed out in order, or shuffled with
    ``shuffle_seed`` (so that no request's blocks are contiguous)."""

    def __init__(self, block_size: int, num_blocks: int, shuffle_seed: int | None = None) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, 2, ...
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.free)
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.params: dict[str, SamplingParams] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.sent: set[str] = set()
        self.finished: set[str] = set()

    def add(self, req_id: str, prompt: list[int], params: SamplingParams | None = None) -> None:
        self.tokens[req_id] = list(prompt)
        self.prompt_len[req_id] = len(prompt)
        self.params[req_id] = params or GREEDY
        self.computed[req_id] = 0
        self.blocks[req_id] = []

    def finish(self, req_id: str) -> None:
        """Forget a request; its blocks return to the free list and the next step tells the executor."""
        self.finished.add(req_id)
        self.free.extend(reversed(self.blocks.pop(req_id)))
        self.sent.discard(req_id)
        for table in (self.tokens, self.prompt_len, self.params, self.computed):
            del table[req_id]

    def step(self, chunks: dict[str, int | None], num_padding_tokens: int = 0) -> SchedulerOutput:
        """Schedule ``chunks[req_id]`` tokens of each request (None: all it has left to compute)."""
        so = SchedulerOutput(num_padding_tokens=num_padding_tokens, finished_req_ids=self.finished)
        self.finished = set()
        for req_id, n in chunks.items():
            computed = self.computed[req_id]
            n = len(self.tokens[req_id]) - computed if n is None else n
            need = cdiv(computed + n, self.block_size) - len(self.blocks[req_id])
            new_blocks = [self.free.pop() for _ in range(max(0, need))]
            self.blocks[req_id] += new_blocks
            if req_id in self.sent:
                so.scheduled_cached_reqs.append(CachedRequestData(req_id, new_blocks, computed))
            else:
                so.scheduled_new_reqs.append(NewRequestData(
                    req_id, list(self.tokens[req_id]), self.prompt_len[req_id], self.params[req_id],
                    list(self.blocks[req_id]), computed))
                self.sent.add(req_id)
            so.num_scheduled_tokens[req_id] = n
            so.total_num_scheduled_tokens += n
        return so

    def update(self, so: SchedulerOutput, out: ModelOutput) -> None:
        """Apply what the executor did: computed counts advance, sampled tokens are appended."""
        for req_id, n in so.num_scheduled_tokens.items():
            self.computed[req_id] += n
        for req_id, token in out.sampled_token_ids.items():
            self.tokens[req_id].append(token)

    def run(self, executor: Executor, chunks: dict[str, int | None], num_padding_tokens: int = 0) -> ModelOutput:
        """``step``, execute it, ``update``; the executor's output."""
        so = self.step(chunks, num_padding_tokens)
        out = executor.execute(so)
        self.update(so, out)
        return out
