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

from conveyor.core.interfaces import KVManager
from conveyor.core.request import Request


class HeldKVManager:
    """Delegates everything to ``inner`` except ``free`` of a held request, which waits for ``release``."""

    def __init__(self, inner: KVManager) -> None:
        self.inner = inner
        self._held: set[str] = set()
        self._freed: dict[str, Request] = {}  # held requests the scheduler has already freed: released later

    def __getattr__(self, name: str):
        # layout, block_size, num_blocks, prefix counters, usage(), allocate_slots(), ...: the real manager's.
        return getattr(self.inner, name)

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
