"""The plug points of the core, as ``typing.Protocol``s: what the scheduler needs from a KV cache manager, and what
the engine needs from an executor. (The policy's interface is ``policies.base.SchedulingPolicy``.)

The docstrings say what each call means; any object with these methods fits (the paged ``KVCacheManager`` and
the baseline ``SlabKVManager``; the torch ``ModelRunner`` and the tests' fake executor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from conveyor.core.outputs import ModelOutput, SchedulerOutput
from conveyor.core.request import Request


class KVManager(Protocol):
    """Owns the KV cache's bookkeeping: which blocks each request holds, and the prefix cache."""

    layout: str  # "paged" or "slab"
    block_size: int
    num_blocks: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache, cumulative
    prefix_hits: int  # of which found
    prefix_saved_tokens: int  # prompt tokens served from the cache at admission, not recomputed, cumulative

    def usage(self) -> float:
        """Fraction of the cache's blocks held by requests (1.0: full)."""

    def num_reserved_slots(self) -> int:
        """Token slots held by requests, used or not (the KV-waste metric's denominator)."""

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table, in token order ([] when it holds none)."""

    @property
    def null_block_id(self) -> int | None:
        """The block id of table entries given back (outside every sliding window): a block outside the pool that
        the runner allocates zeroed and never writes. None when nothing is ever given back this way."""

    def num_skipped_blocks(self, request_id: str) -> int:
        """How many leading entries of the request's table are ``null_block_id`` (the executor is told)."""

    def get_computed_blocks(self, request: Request) -> tuple[Sequence[object], int]:
        """The longest cached prefix of a request about to be admitted: (blocks, number of tokens they hold).

        Takes no reference: pass the blocks to ``allocate_slots`` in the same step."""

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[object] | None = None) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; the newly allocated block ids, or None if they do not fit.

        Checks and commits in one call: on None nothing changed."""

    def free(self, request: Request) -> None:
        """Release every block the request holds (no-op when it holds none)."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks stay where they are)."""

    def check_invariants(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent."""


class Executor(Protocol):
    """Runs one step. Keeps per-request state across steps (see ``outputs``): new requests arrive whole, then as
    deltas; ``finished_req_ids`` and ``preempted_req_ids`` say what to forget."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Compute the scheduled tokens (and the padding); return one sampled token per request that samples."""
