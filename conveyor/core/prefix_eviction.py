"""Which cached block the prefix cache gives up first: the free-block orders behind ``--prefix-cache-eviction``.

``BlockPool`` keeps its free blocks in one of these, chosen by name (``make_free_blocks``):

- ``lru`` (default): ``block_pool.FreeBlockList``, the least recently freed cached block first. Unchanged.
- ``cost``: ``CostAwareFreeBlocks`` below, GreedyDual-Size-Frequency (Cherkasova 1998) over a block chain.

Why GDSF and not ``hits x prefix length / age`` as written: a score divided by the current age changes for every
block at every tick, and two blocks' order can flip while neither is touched, so no heap can hold it and each
eviction would rescan all n free blocks. GDSF gets the same three factors with a fixed key: a block entering the
free list gets ``priority = L + value`` (value = hits x recompute cost), the lowest priority goes first, and
``L`` (the inflation clock) rises to each evicted block's priority. A block that is not hit again falls behind
as L passes it: that is its age, without reading a clock (core never does). A heap with lazy deletion then makes
an eviction O(log n) and a hit's removal O(1).

Why leaves first: a lookup walks a request's keys from the first block and stops at the first miss, so evicting a
parent makes every cached descendant unreachable (their KV stays in memory, useless, until evicted in turn; it
becomes reachable again only if the same parent is recomputed and cached). Hits on a child are always hits on
its parent as well, but the recompute cost grows with the position, so a child can outscore its parent: ranking by
score alone would cut chains in the middle. The policy therefore evicts only blocks without a cached child while
one exists (children are counted per block), and ranks by score among those; a block with cached children goes
only when every free cached block has one (their children are in use), the lowest score first.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # block_pool builds this class: a runtime import back would be a cycle
    from conveyor.core.block_pool import FreeBlockList, KVBlock

PREFIX_EVICTION_POLICIES = ("lru", "cost")
# Rebuild the heap when stale entries outnumber live ones by this factor (plus a floor): amortized O(1) per
# entry pushed, and the heap never holds more than ~3x the free cached blocks.
_COMPACT_FACTOR, _COMPACT_FLOOR = 2, 64


class CostAwareFreeBlocks:
    """The free blocks of a pool: unhashed ones in a list (handed out first: they hold nothing reusable, as under
    LRU), cached ones in a min-heap keyed by (has a cached child, GDSF priority, freed order).

    The same interface as ``FreeBlockList`` (``num_free``, ``append``, ``appendleft``, ``remove``, ``popleft``,
    iteration) plus the hooks the pool calls on a hit, on caching a block and on dropping a block's hash.
    """

    def __init__(self, unhashed: FreeBlockList, num_blocks: int) -> None:
        """``unhashed``: a ``FreeBlockList`` holding the pool's free blocks (all of them, at start)."""
        n = num_blocks
        self.unhashed = unhashed
        self.heap: list[tuple[int, float, int, KVBlock]] = []
        self.clock = 0.0  # GDSF's L: the priority of the last block evicted
        self._seq = 0  # ties (equal priority) go in freed order: LRU among equals
        self.num_scored = 0  # cached blocks in the heap (live entries)
        # Per block id (the policy's own state, so KVBlock stays as LRU uses it):
        self.entry = [-1] * n  # seq of the block's live heap entry; -1: not in the heap
        self.priority = [0.0] * n
        self.hits = [0] * n  # prefix-cache hits since the block was cached
        self.position = [0] * n  # index of the block in its chain (0: a request's first block)
        self.children = [0] * n  # cached blocks whose parent key this block holds
        self.parent: list[tuple[KVBlock, int] | None] = [None] * n  # (parent block, its generation)
        self.gen = [0] * n  # bumped whenever the block's hash is dropped: stale parent links stop counting

    # ---- the free-list interface ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.unhashed.num_free + self.num_scored

    def append(self, block: KVBlock) -> None:
        """A block whose last reference went: a cached one is scored now (its GDSF access), others listed."""
        if block.block_hash is None:
            self.unhashed.append(block)
            return
        bid = block.block_id
        # value = hits x recompute cost; the cost of a block is the tokens up to and including it (in blocks): the
        # attention work of recomputing it grows with its position. A block never hit scores L: first to go.
        self.priority[bid] = self.clock + self.hits[bid] * (self.position[bid] + 1)
        self._push(block)
        self.num_scored += 1

    def appendleft(self, block: KVBlock) -> None:
        if block.block_hash is None:
            self.unhashed.appendleft(block)
        else:
            self.append(block)

    def remove(self, block: KVBlock) -> None:
        """Take a free block out (a cache hit): O(1), its heap entry goes stale."""
        bid = block.block_id
        if self.entry[bid] >= 0:
            self.entry[bid] = -1
            self.num_scored -= 1
        else:
            self.unhashed.remove(block)

    def popleft(self) -> KVBlock:
        """The block to hand out: an unhashed one if any, else the cheapest cached leaf (evicted by the pool)."""
        if self.unhashed.num_free:
            return self.unhashed.popleft()
        while True:
            assert self.heap, "no free block"
            _, priority, seq, block = heapq.heappop(self.heap)
            if self.entry[block.block_id] == seq:
                break
        self.entry[block.block_id] = -1
        self.num_scored -= 1
        self.clock = max(self.clock, priority)
        return block

    def __iter__(self) -> Iterator[KVBlock]:
        yield from self.unhashed
        for _, _, seq, block in self.heap:
            if self.entry[block.block_id] == seq:
                yield block

    # ---- hooks ------------------------------------------------------------------------------------------
    def on_hit(self, block: KVBlock) -> None:
        self.hits[block.block_id] += 1

    def on_cached(self, block: KVBlock, parent: KVBlock | None, position: int) -> None:
        """``block`` just got its key; ``parent`` holds the key before it (None: first block, or not cached)."""
        bid = block.block_id
        self.hits[bid] = 0
        self.position[bid] = position
        self.children[bid] = 0
        if parent is None:
            self.parent[bid] = None
            return
        pid = parent.block_id
        self.parent[bid] = (parent, self.gen[pid])
        self.children[pid] += 1
        if self.children[pid] == 1 and self.entry[pid] >= 0:
            self._push(parent)  # a free parent (its holder was a duplicate) stops being a leaf: re-key it

    def on_evicted(self, block: KVBlock) -> None:
        """``block``'s hash was dropped (evicted for reuse, or the cache reset)."""
        bid = block.block_id
        self.gen[bid] += 1  # its children's links to it are stale now (they are orphans)
        link = self.parent[bid]
        self.parent[bid] = None
        self.children[bid] = self.hits[bid] = 0
        if link is not None:
            parent, gen = link
            pid = parent.block_id
            if self.gen[pid] == gen:
                self.children[pid] -= 1
                if self.children[pid] == 0 and self.entry[pid] >= 0:
                    self._push(parent)  # the parent became a leaf while free: re-key it

    def on_reset(self) -> None:
        """Every hash was dropped in place: the scored blocks join the unhashed list, all links are void."""
        live = [block for block in self if block.block_hash is None and self.entry[block.block_id] >= 0]
        for block in live:
            self.entry[block.block_id] = -1
            self.unhashed.append(block)
        self.num_scored -= len(live)
        self.heap = [e for e in self.heap if self.entry[e[3].block_id] == e[2]]
        heapq.heapify(self.heap)
        for bid in range(len(self.gen)):
            self.gen[bid] += 1
            self.parent[bid] = None
            self.children[bid] = self.hits[bid] = 0

    # ---- internals --------------------------------------------------------------------------------------
    def _push(self, block: KVBlock) -> None:
        """(Re-)enter ``block`` in the heap under its current priority and leaf status; older entries go stale."""
        bid = block.block_id
        self._seq += 1
        self.entry[bid] = self._seq
        heapq.heappush(self.heap, (1 if self.children[bid] else 0, self.priority[bid], self._seq, block))
        if len(self.heap) > _COMPACT_FACTOR * self.num_scored + _COMPACT_FLOOR:
            self.heap = [e for e in self.heap if self.entry[e[3].block_id] == e[2]]
            heapq.heapify(self.heap)

    def check_invariants(self, blocks: list[KVBlock], cached: dict) -> None:
        """The policy's own bookkeeping: live entries are free cached blocks, child counts match the links."""
        live = [e for e in self.heap if self.entry[e[3].block_id] == e[2]]
        assert len(live) == self.num_scored, "scored-block count != live heap entries"
        assert len({e[3].block_id for e in live}) == len(live), "a block has two live heap entries"
        for _, _, _, block in live:
            assert block.ref_cnt == 0 and block.block_hash is not None, f"{block}: scored but in use or unhashed"
            assert self.entry[block.block_id] >= 0
        for block in self.unhashed:
            assert block.block_hash is None, f"{block}: cached but in the unhashed list"
        counted = [0] * len(self.children)
        for block in cached.values():
            link = self.parent[block.block_id]
            if link is not None and self.gen[link[0].block_id] == link[1]:
                assert link[0].block_hash is not None, f"{block}: live link to an unhashed parent"
                counted[link[0].block_id] += 1
        for block in blocks:
            if block.block_hash is not None:
                assert counted[block.block_id] == self.children[block.block_id], f"{block}: child count wrong"
        for has_child, _, _, block in live:  # a live entry's leaf flag is current (re-keyed when it changed)
            assert has_child == (1 if self.children[block.block_id] else 0), f"{block}: stale leaf flag"
