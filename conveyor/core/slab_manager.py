"""Slab KV layout (baseline): each admitted request reserves ``max_model_len`` token slots up front.

This is how KV caches were laid out before paging: one contiguous slab per batch slot, sized for the longest
sequence the model allows, whatever the request will actually use. Concurrency is capped at
``num_blocks // blocks_per_slab`` no matter how short the requests are, and most of a slab stays empty
(the KV-waste metric, 1 - tokens stored / slots reserved, shows how much).

The cache is still addressed in blocks so the same runner serves both layouts: slab ``i`` is the contiguous
block range ``[i * blocks_per_slab, (i + 1) * blocks_per_slab)``, handed over whole at admission::

    blocks:  | slab 0              | slab 1              | ... | slab n-1            | leftover |
             | b0 b1 ... b(k-1)    | bk ... b(2k-1)      |     |                     | (unused) |

Implements ``interfaces.KVManager`` as ``KVCacheManager`` does; no prefix sharing (a slab belongs to one request).
"""

from __future__ import annotations

from conveyor.core.block_pool import cdiv
from conveyor.core.request import Request


class SlabKVManager:
    """Contiguous per-request slabs of ``max_model_len`` tokens over ``num_blocks`` blocks of ``block_size``."""

    layout = "slab"

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        if block_size < 1 or max_model_len < 1:
            raise ValueError(f"block_size and max_model_len must be >= 1, got {block_size}, {max_model_len}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.blocks_per_slab = cdiv(max_model_len, block_size)
        self.num_slabs = num_blocks // self.blocks_per_slab
        if self.num_slabs < 1:
            raise ValueError(f"{num_blocks} blocks of {block_size} tokens cannot hold one slab of {max_model_len}")
        # Lowest slab first, so a run's slab assignment is reproducible.
        self.free_slabs: list[int] = list(range(self.num_slabs - 1, -1, -1))
        self.req_slab: dict[str, int] = {}
        self.prefix_queries = 0  # no prefix caching in this layout: always 0
        self.prefix_hits = 0
        self.prefix_saved_tokens = 0
        self.prefix_evictions = 0
        self.num_evicted_blocks = 0  # nor KV eviction: a slab is reserved whole

    def usage(self) -> float:
        return len(self.req_slab) * self.blocks_per_slab / self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_slabs) * self.blocks_per_slab

    def num_reserved_slots(self) -> int:
        """Token slots held by running requests: whole slabs, used or not."""
        return len(self.req_slab) * self.blocks_per_slab * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        slab = self.req_slab.get(request_id)
        if slab is None:
            return []
        first = slab * self.blocks_per_slab
        return list(range(first, first + self.blocks_per_slab))

    def blocks_of(self, request_id: str) -> list:
        """Slabs hold block ids, not shared block objects: nothing to read."""
        return []

    null_block_id = None  # a slab is held whole: nothing outside a sliding window is given back

    def num_skipped_blocks(self, request_id: str) -> int:
        """Never any: see ``null_block_id``."""
        return 0

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        """No prefix sharing across slabs: never a hit."""
        return [], 0

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """The whole slab's block ids at a request's first allocation, [] afterwards; None if it does not fit.

        A request that already holds a slab always fits up to ``max_model_len`` tokens; a new one needs a free
        slab. Checks and commits in one call, like the paged manager.
        """
        assert not computed_blocks, "the slab layout has no prefix hits"
        if request.num_computed_tokens + num_new_tokens + num_lookahead_tokens > self.blocks_per_slab * self.block_size:
            return None
        if request.request_id in self.req_slab:
            return []
        if not self.free_slabs:
            return None
        self.req_slab[request.request_id] = self.free_slabs.pop()
        return self.block_ids(request.request_id)

    def trim(self, request: Request, num_tokens: int) -> int | None:
        """A slab is reserved whole for the request's life: nothing goes back before it ends."""
        return None

    def evict_blocks(self, request: Request, indices: list[int]) -> None:
        raise ValueError("the slab layout reserves a whole slab per request: it has no blocks to evict")

    def free(self, request: Request) -> None:
        slab = self.req_slab.pop(request.request_id, None)
        if slab is not None:
            self.free_slabs.append(slab)

    def reset_prefix_cache(self) -> None:
        """Slabs share nothing, so there is no prefix cache to forget."""

    # Nothing is ever findable: a step cut short has nothing to take back.
    def begin_step(self) -> None:
        pass

    def step_published_shared(self) -> bool:
        return False

    def unpublish_step(self) -> None:
        pass

    def check_invariants(self) -> None:
        held = list(self.req_slab.values())
        assert len(set(held)) == len(held), "a slab is held by two requests"
        assert not set(held) & set(self.free_slabs), "a slab is both held and free"
        assert len(set(self.free_slabs)) == len(self.free_slabs), "a slab was freed twice"
        assert len(held) + len(self.free_slabs) == self.num_slabs, "free + held slabs != total"
