"""A KV manager whose frees can be held back while a request's KV is being sent away. PURE PYTHON.

On a prefill instance a request finishes when its first token is sampled, and the real scheduler frees its blocks
at once. But those blocks are the source of the transfer to the decode instance: they must stay allocated until
the copy ends. vLLM's KV connectors do the same (``request_finished`` returns ``delay_free_blocks=True`` and the
blocks are freed when the connector reports the send done). ``HeldKVManager`` wraps the real KV manager,
unchanged: ``hold(request_id)`` before the scheduler's update, and its ``free`` of that request only takes note;
``release(request_id)`` frees for real. While held the blocks count as used, so the prefill instance admits less:
a slow link or a full decode side pushes back on prefill, as it would on a real cluster.
"""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.core.block_pool import KVBlock
from conveyor.core.interfaces import KVManager
from conveyor.core.request import Request


class HeldKVManager:
    """A ``KVManager``: ``inner``'s answers, except that ``free`` of a held request waits for ``release``."""

    def __init__(self, inner: KVManager) -> None:
        self.inner = inner
        self._held: set[str] = set()
        self._freed: dict[str, Request] = {}  # held requests the scheduler has already freed: released later

    # ---- KVManager, the inner manager's -------------------------------------------------------------------
    layout = property(lambda self: self.inner.layout)
    block_size = property(lambda self: self.inner.block_size)
    num_blocks = property(lambda self: self.inner.num_blocks)
    prefix_queries = property(lambda self: self.inner.prefix_queries)
    prefix_hits = property(lambda self: self.inner.prefix_hits)
    prefix_saved_tokens = property(lambda self: self.inner.prefix_saved_tokens)
    prefix_evictions = property(lambda self: self.inner.prefix_evictions)
    num_evicted_blocks = property(lambda self: self.inner.num_evicted_blocks)
    num_free_blocks = property(lambda self: self.inner.num_free_blocks)
    null_block_id = property(lambda self: self.inner.null_block_id)

    def usage(self) -> float:
        return self.inner.usage()

    def num_reserved_slots(self) -> int:
        return self.inner.num_reserved_slots()

    def block_ids(self, request_id: str) -> list[int]:
        return self.inner.block_ids(request_id)

    def blocks_of(self, request_id: str) -> Sequence[KVBlock]:
        return self.inner.blocks_of(request_id)

    def num_skipped_blocks(self, request_id: str) -> int:
        return self.inner.num_skipped_blocks(request_id)

    def get_computed_blocks(self, request: Request) -> tuple[Sequence[object], int]:
        return self.inner.get_computed_blocks(request)

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[object] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        return self.inner.allocate_slots(request, num_new_tokens, computed_blocks, num_lookahead_tokens)

    def trim(self, request: Request, num_tokens: int) -> int | None:
        return self.inner.trim(request, num_tokens)

    def evict_blocks(self, request: Request, indices: list[int]) -> None:
        self.inner.evict_blocks(request, indices)

    def reset_prefix_cache(self) -> None:
        self.inner.reset_prefix_cache()

    def begin_step(self) -> None:
        self.inner.begin_step()

    def step_published_shared(self) -> bool:
        return self.inner.step_published_shared()

    def unpublish_step(self) -> None:
        self.inner.unpublish_step()

    # ---- holding ------------------------------------------------------------------------------------------

    def hold(self, request_id: str) -> None:
        """The next ``free`` of this request keeps its blocks until ``release``."""
        self._held.add(request_id)

    def free(self, request: Request) -> None:
        if request.request_id in self._held:
            self._freed[request.request_id] = request
            return
        self.inner.free(request)

    def release(self, request_id: str) -> None:
        """Free the blocks of a held request (its transfer ended). Its free must have happened already."""
        self._held.discard(request_id)
        self.inner.free(self._freed.pop(request_id))

    @property
    def num_held(self) -> int:
        return len(self._freed)

    def check_invariants(self) -> None:
        self.inner.check_invariants()
        assert set(self._freed) <= self._held, "a released request is still counted as held"
