"""The plug points of the core, as ``typing.Protocol``s: what the scheduler needs from a KV cache manager, and what
the engine needs from an executor (a step, and the KV copies of a hand-over). (The policy's interface is
``policies.base.SchedulingPolicy``.)

The docstrings say what each call means; any object with these methods fits (the paged ``KVCacheManager`` and
the baseline ``SlabKVManager``; the torch ``ModelRunner`` and the tests' fake executor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from conveyor.core.block_pool import KVBlock
from conveyor.core.outputs import ModelOutput, SchedulerOutput
from conveyor.core.request import Request


class KVManager(Protocol):
    """Owns the KV cache's bookkeeping: which blocks each request holds, and the prefix cache.

    Everything the scheduler and its policy objects use is declared here (``tests/test_protocols.py`` checks it).
    Giving blocks back in the middle of a request's life (``trim``, ``evict_blocks``) is the paged layout's; the
    scheduler turns speculation and KV eviction on only with ``layout`` "paged"."""

    layout: str  # "paged" or "slab"
    block_size: int
    num_blocks: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache, cumulative
    prefix_hits: int  # of which found
    prefix_saved_tokens: int  # prompt tokens served from the cache at admission, not recomputed, cumulative
    prefix_evictions: int  # cached blocks whose KV was given up for reuse, cumulative
    num_evicted_blocks: int  # blocks given back by KV eviction (``evict_blocks``), cumulative

    def usage(self) -> float:
        """Fraction of the cache's blocks held by requests (1.0: full)."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached free blocks included: a new request may take them)."""

    def num_reserved_slots(self) -> int:
        """Token slots held by requests, used or not (the KV-waste metric's denominator)."""

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table, in token order ([] when it holds none)."""

    def blocks_of(self, request_id: str) -> Sequence[KVBlock]:
        """The request's blocks themselves, in table order (read their ref counts; change nothing)."""

    @property
    def null_block_id(self) -> int | None:
        """The block id of table entries given back (outside every sliding window): a block outside the pool that
        the runner allocates zeroed and never writes. None when nothing is ever given back this way."""

    def num_skipped_blocks(self, request_id: str) -> int:
        """How many leading entries of the request's table are ``null_block_id`` (the executor is told)."""

    def get_computed_blocks(self, request: Request) -> tuple[Sequence[object], int]:
        """The longest cached prefix of a request about to be admitted: (blocks, number of tokens they hold).

        Takes no reference: pass the blocks to ``allocate_slots`` in the same step."""

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[object] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; the newly allocated block ids, or None if they do not fit.

        Checks and commits in one call: on None nothing changed. ``num_lookahead_tokens`` more slots are reserved
        after them for proposed tokens (speculative decoding), which ``trim`` gives back when rejected."""

    def trim(self, request: Request, num_tokens: int) -> int | None:
        """Give back the blocks past the first ``num_tokens`` tokens' (rejected proposals' slots); how many blocks
        it kept, or None when it gave none back."""

    def evict_blocks(self, request: Request, indices: list[int]) -> None:
        """KV eviction: drop the blocks at these (ascending) indices of the request's table, back to the pool."""

    def free(self, request: Request) -> None:
        """Release every block the request holds (no-op when it holds none)."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks stay where they are)."""

    def begin_step(self) -> None:
        """A step's scheduling starts: what it makes findable in the prefix cache from here on, ``unpublish_step``
        can take back."""

    def step_published_shared(self) -> bool:
        """Whether a request took a prefix hit on a block this step made findable (then the step is not cut:
        the hit counts as computed KV the step has yet to compute)."""

    def unpublish_step(self) -> None:
        """The step scheduled since ``begin_step`` was cut short, nothing of it computed: no block it made
        findable stays findable (each is offered again when its tokens are scheduled again)."""

    def check_invariants(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent."""


class Executor(Protocol):
    """Runs one step. Keeps per-request state across steps (see ``outputs``): new requests arrive whole, then as
    deltas; ``finished_req_ids`` and ``preempted_req_ids`` say what to forget."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Compute the scheduled tokens (and the padding); return one sampled token per request that samples."""


class KVTransfer(Protocol):
    """Copies a request's KV out of an executor's cache and into another's (disaggregated prefill / decode:
    ``engine.kv_handoff``). The tensors are the runner's per-token wire form (``runner.kv_io``): typed ``Any`` here,
    where nothing imports torch."""

    def export_kv(self, request_id: str, block_ids: list[int], num_tokens: int) -> tuple[Any, Any | None]:
        """The K/V of the request's first ``num_tokens`` tokens in ``block_ids``, and its seeded sampling
        generator's state (None when unseeded)."""

    def import_kv(self, request_id: str, block_ids: list[int], kv: Any, generator_state: Any | None) -> None:
        """Write handed-over ``kv`` into ``block_ids`` (after the schedule that admitted the request, before the
        ``execute`` that first sees it); its generator takes ``generator_state`` in that ``execute``."""


class EngineExecutor(Executor, KVTransfer, Protocol):
    """What ``LLMEngine`` uses of its executor: the step, and the hand-over's copies (``ModelRunner``)."""
