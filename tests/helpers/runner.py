"""A tiny stand-in for the scheduler, to drive ModelRunner in tests with hand-chosen chunks.

It hands out block ids in a shuffled order (so no request's blocks are contiguous), tracks each request's
tokens and computed count, and builds the SchedulerOutput deltas the real scheduler would send.
"""

from __future__ import annotations

import random

from conveyor.core.outputs import CachedRequestData, ModelOutput, NewRequestData, SchedulerOutput
from conveyor.core.sampling_params import SamplingParams


class MiniScheduler:
    def __init__(self, block_size: int, num_blocks: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
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
        self.params[req_id] = params or SamplingParams(temperature=0.0, max_tokens=100)
        self.computed[req_id] = 0
        self.blocks[req_id] = []

    def finish(self, req_id: str) -> None:
        self.finished.add(req_id)
        self.free.extend(reversed(self.blocks.pop(req_id)))
        self.sent.discard(req_id)

    def step(self, chunks: dict[str, int], num_padding_tokens: int = 0) -> SchedulerOutput:
        """Schedule chunks[req_id] tokens of each request (None: all remaining ones)."""
        so = SchedulerOutput(num_padding_tokens=num_padding_tokens, finished_req_ids=self.finished)
        self.finished = set()
        for req_id, n in chunks.items():
            remaining = len(self.tokens[req_id]) - self.computed[req_id]
            n = remaining if n is None else n
            need = -(-(self.computed[req_id] + n) // self.block_size) - len(self.blocks[req_id])
            new_blocks = [self.free.pop() for _ in range(max(0, need))]
            self.blocks[req_id] += new_blocks
            if req_id in self.sent:
                so.scheduled_cached_reqs.append(CachedRequestData(req_id, new_blocks, self.computed[req_id]))
            else:
                so.scheduled_new_reqs.append(NewRequestData(
                    req_id, list(self.tokens[req_id]), self.prompt_len[req_id], self.params[req_id],
                    list(self.blocks[req_id]), self.computed[req_id]))
                self.sent.add(req_id)
            so.num_scheduled_tokens[req_id] = n
            so.total_num_scheduled_tokens += n
        return so

    def update(self, so: SchedulerOutput, out: ModelOutput) -> None:
        for req_id, n in so.num_scheduled_tokens.items():
            self.computed[req_id] += n
        for req_id, token in out.sampled_token_ids.items():
            self.tokens[req_id].append(token)

    def run(self, runner, chunks: dict[str, int], num_padding_tokens: int = 0) -> ModelOutput:
        so = self.step(chunks, num_padding_tokens)
        out = runner.execute(so)
        self.update(so, out)
        return out
