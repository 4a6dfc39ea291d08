"""Paged KV cache bookkeeping: per-request block tables over a shared ``BlockPool``, with prefix caching.

Token layout of a request's block table at ``allocate_slots`` (block_size 4, a prefix hit of 2 blocks)::

    tokens:  | c c c c | c c c c | n n n n | n n . . |
             |<-- prefix hit: -->|<-- new tokens: -->|
             | computed_blocks   | newly allocated   |   '.' = slots reserved for later tokens
             | (touched, shared) | blocks            |

Every block that is full once this step's tokens are computed gets its chained hash, so a later request with
the same prefix finds it (even in the same step: the runner writes a layer's K/V before any attention reads).

With a ``sliding_window`` (every layer has one: ``core.sliding_window``), the blocks before the window of a
request's next token go back to the pool as it advances, their entries pointing at the null block::

    tokens:  | c c c c | c c c c | c c c c | c c n n |      window 6: the next token (at 14) sees keys 9 .. 14
    table:   | null    | null    | b7      | b3      |
"""

from __future__ import annotations

from conveyor.core.block_pool import ROOT_KEY, BlockHash, BlockPool, KVBlock, cdiv, hash_block
from conveyor.core.lora_request import prefix_root
from conveyor.core.request import Request
from conveyor.core.sliding_window import SlidingWindow


class KVCacheManager:
    """Paged layout: a request holds just the blocks its tokens need, growing one block at a time."""

    layout = "paged"

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefix_cache_eviction: str = "lru", sliding_window: int = 0) -> None:
        """``sliding_window``: the window every layer attends within (``sliding_window.freeable_window``); blocks
        outside it are given back as requests advance. 0: some layer sees every earlier key, nothing is freed."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, prefix_cache_eviction)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.window = SlidingWindow(sliding_window, block_size) if sliding_window else None
        # The entry of a freed block: outside the pool (id num_blocks), allocated zeroed by the runner, never written
        self.null_block = KVBlock(num_blocks) if self.window else None
        self.num_skipped: dict[str, int] = {}  # leading entries of each table that are the null block
        # How many leading blocks of each table were offered to the cache: each step looks only at the blocks that
        # filled since (a decode fills one block in block_size steps), not the whole table again. A block whose
        # hash another block already holds stays unhashed and is not offered again (vLLM does the same).
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        # Of the hits, the tokens whose KV a request really took (committed by allocate_slots): what the cache
        # saved. Less than prefix_hits when an admission found its prefix but had no room and looked again later
        # (vLLM counts queries and hits the same way, per lookup).
        self.prefix_saved_tokens = 0
        self.num_evicted_blocks = 0  # blocks given back by KV eviction (core.kv_eviction), cumulative
        # The step being scheduled (since begin_step): the blocks it made findable, in order, and each request's
        # num_cached_blocks before it, so a step cut short takes them back (unpublish_step)
        self._published: list[KVBlock] = []
        self._cached_before: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def num_reserved_slots(self) -> int:
        """Token slots held by running requests (for the KV-waste metric)."""
        return (sum(len(b) for b in self.req_blocks.values()) - sum(self.num_skipped.values())) * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def prefix_evictions(self) -> int:
        return self.pool.num_evictions

    def blocks_of(self, request_id: str) -> list[KVBlock]:
        return self.req_blocks.get(request_id, [])

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table; entries outside every window are ``null_block_id``."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    @property
    def null_block_id(self) -> int | None:
        """The id freed entries point at (``num_blocks``: the runner allocates it zeroed), None without a window."""
        return None if self.null_block is None else self.null_block.block_id

    def num_skipped_blocks(self, request_id: str) -> int:
        """How many leading entries of the request's table are the null block (given back: outside every window)."""
        return self.num_skipped.get(request_id, 0)

    def _update_block_hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        """Extend ``request.block_hashes`` to cover every full block among its first ``num_tokens`` tokens."""
        hashes = request.block_hashes
        n_full = num_tokens // self.block_size
        if len(hashes) < n_full:
            tokens = request.all_token_ids
            bs = self.block_size
            parent = hashes[-1] if hashes else prefix_root(ROOT_KEY, request.sampling_params.lora)
            for i in range(len(hashes), n_full):
                parent = hash_block(parent, tokens[i * bs : (i + 1) * bs])
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of ``request`` as (blocks, tokens). Takes no reference yet.

        The last token is never served from the cache: it must be computed to produce the next token's logits.
        Nor is anything of a request that wants prompt logprobs, or of a pooling request: they need every prompt
        position's logits or hidden states (vLLM skips the cache for them too).
        """
        params = request.sampling_params
        if not (self.enable_prefix_caching or request.share_prefix) or params.prompt_logprobs is not None or \
                params.pooling is not None:
            return [], 0
        max_hit_tokens = request.num_tokens - 1
        hashes = self._update_block_hashes(request, max_hit_tokens)
        if self.window is not None:  # only the blocks its window reaches need to be cached (null before them)
            hits = self.window.longest_hit(hashes, self.pool.lookup, self.null_block)
        else:
            hits = []
            for h in hashes:
                block = self.pool.lookup(h)
                if block is None:
                    break
                hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Reserve slots for ``num_new_tokens`` more tokens; return the new block ids, or None if they don't fit.

        Checks and commits in one call: on None nothing changed. ``computed_blocks`` (a prefix hit from
        ``get_computed_blocks``, only for a request that holds no blocks yet) are referenced in the same commit.
        ``num_lookahead_tokens`` more slots are reserved after them for proposed tokens (speculative decoding):
        their tokens are not the request's yet, so no block they fill is offered to the prefix cache, and
        ``trim`` gives back what verification rejects.

        With a sliding window, the held blocks outside the window of the first new token go back first, even when
        the new ones then do not fit (no later step reads them; the freed room counts).
        """
        computed_blocks = computed_blocks or []
        rid = request.request_id
        held = self.req_blocks.get(rid, [])
        assert not (held and computed_blocks), "a prefix hit is only taken at admission"
        # KV slots, not positions: blocks evicted from the middle of the table hold none of the request's tokens
        num_computed = request.num_computed_tokens - request.num_evicted_tokens \
            + len(computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        skipped = self.window.num_skipped_blocks(num_computed) if self.window is not None else 0
        if held and skipped:
            self._free_skipped(rid, held, skipped)
        hits = [b for b in computed_blocks if b is not self.null_block]
        assert len(computed_blocks) - len(hits) == min(skipped, len(computed_blocks)), "a hit holds a skipped block"
        # A request handed over with its KV computed elsewhere starts with entries it never needs to hold.
        num_null_new = max(0, skipped - len(held) - len(computed_blocks))
        num_needed = cdiv(total_tokens + num_lookahead_tokens, self.block_size) - len(held) - len(computed_blocks) \
            - num_null_new
        # Hit blocks that sit in the free list stop being free when touched: they count against the room.
        num_hits_free = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed + num_hits_free > self.pool.num_free_blocks:
            return None
        self.pool.touch(hits)
        self.prefix_saved_tokens += len(computed_blocks) * self.block_size
        new_blocks = self.pool.allocate(max(num_needed, 0))
        blocks = self.req_blocks.setdefault(rid, [])
        blocks.extend(computed_blocks)
        blocks.extend([self.null_block] * num_null_new)
        blocks.extend(new_blocks)
        if skipped and not held:
            self.num_skipped[rid] = skipped
        self._cache_full_blocks(request, blocks, total_tokens)
        return [b.block_id for b in new_blocks]

    def _free_skipped(self, request_id: str, blocks: list[KVBlock], skipped: int) -> None:
        """Give back the held blocks among the first ``skipped`` of a table (outside every window), tail first as
        ``free`` orders them, and point their entries at the null block (those before ``num_skipped`` already are)."""
        freed = []
        for i in range(min(skipped, len(blocks)) - 1, self.num_skipped.get(request_id, 0) - 1, -1):
            freed.append(blocks[i])
            blocks[i] = self.null_block
        if freed:
            self.num_skipped[request_id] = min(skipped, len(blocks))
            self.pool.free(freed)

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # request.block_hashes may run ahead (a prefix lookup hashes the whole prompt): only blocks that are
        # full once this step's tokens are computed may become findable.
        if request.num_evicted_tokens:
            # After an eviction the table's index is no longer the token block's, and the KV written from then on
            # attended to fewer keys than the exact model's would: no later request may be served it.
            return
        n_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if n_full <= start:
            return
        hashes = self._update_block_hashes(request, num_tokens)
        self._cached_before.setdefault(request.request_id, start)
        for i in range(start, n_full):
            if blocks[i].block_hash is None and blocks[i] is not self.null_block:
                self.pool.cache_full_block(blocks[i], hashes[i], hashes[i - 1] if i else None, i)
                if blocks[i].block_hash == hashes[i]:
                    self._published.append(blocks[i])
        self.num_cached_blocks[request.request_id] = n_full

    def begin_step(self) -> None:
        """A step's scheduling starts: the blocks it makes findable from here on can be taken back."""
        self._published.clear()
        self._cached_before.clear()

    def step_published_shared(self) -> bool:
        """Whether a request took a reference on a block this step made findable (a prefix hit in the same step,
        which counts the block's tokens as computed before the step computes them)."""
        return any(block.ref_cnt > 1 for block in self._published)

    def unpublish_step(self) -> None:
        """The step scheduled since ``begin_step`` computed nothing (it was cut short): the blocks it made findable
        hold no KV (or a part of their layers'), so no one may find them; they are offered again when the step's
        tokens are scheduled again. (Blocks stay where they are: the redo writes them.)"""
        for block in reversed(self._published):  # children before their parents, as eviction drops them
            if block.block_hash is not None:
                self.pool.uncache_block(block)
        for rid, start in self._cached_before.items():
            if rid in self.num_cached_blocks:
                self.num_cached_blocks[rid] = min(self.num_cached_blocks[rid], start)
        self.begin_step()

    def trim(self, request: Request, num_tokens: int) -> int | None:
        """Give back the blocks past the first ``num_tokens`` tokens' (rejected proposals' slots), tail first;
        returns how many blocks it kept, None when it gave none back. Those blocks were never offered to the
        prefix cache: nothing findable is lost."""
        blocks = self.req_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return None
        extra = blocks[keep:]
        del blocks[keep:]
        assert all(b.block_hash is None and b is not self.null_block for b in extra), \
            "a trimmed block was in the prefix cache, or outside the window"
        self.pool.free(reversed(extra))
        return keep

    def evict_blocks(self, request: Request, indices: list[int]) -> None:
        """KV eviction: drop the blocks at ``indices`` (ascending) of the request's table and give them back to the
        pool. Each must be full, computed and held by this request alone (``core.kv_eviction`` chooses only
        those): a shared block is another request's KV too, and dropping our reference would free nothing.

        A dropped block that carries a hash stays findable in the free list: its KV was computed exactly (no
        block is hashed after a request's first eviction), so a later prefix hit on it is still right."""
        assert self.window is None, "KV eviction is refused with a sliding window (slots must stay positions)"
        blocks = self.req_blocks[request.request_id]
        n_full = (request.num_computed_tokens - request.num_evicted_tokens) // self.block_size
        gone = set(indices)
        assert len(gone) == len(indices) and all(0 <= i < n_full for i in gone), f"bad eviction {indices}"
        removed = [blocks[i] for i in indices]
        assert all(b.ref_cnt == 1 for b in removed), "evicting a shared block"
        blocks[:] = [b for i, b in enumerate(blocks) if i not in gone]
        self.num_cached_blocks.pop(request.request_id, None)  # nothing of it is offered to the cache again
        request.num_evicted_tokens += len(removed) * self.block_size
        self.num_evicted_blocks += len(removed)
        self.pool.free(reversed(removed))

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first (see the ordering rule in block_pool)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        skipped = self.num_skipped.pop(request.request_id, 0)
        request.num_evicted_tokens = 0  # its KV is gone: a recompute starts exact
        self.pool.free(reversed(blocks[skipped:]))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (blocks stay where they are)."""
        self.pool.reset_prefix_cache()
        self.num_cached_blocks.clear()  # held full blocks get their hashes again at their next allocation

    def check_invariants(self) -> None:
        owners: dict[int, int] = {}
        for rid, table in self.req_blocks.items():
            skipped = self.num_skipped.get(rid, 0)
            blocks = table[skipped:]
            assert all(b is self.null_block for b in table[:skipped]), f"{rid}: a skipped entry is not null"
            assert self.null_block not in blocks, f"{rid}: a null entry after the held blocks"
            assert len({b.block_id for b in blocks}) == len(blocks), "a block appears twice in one block table"
            for block in blocks:
                owners[block.block_id] = owners.get(block.block_id, 0) + 1
        assert set(self.num_skipped) <= set(self.req_blocks), "skipped entries counted for a request holding none"
        for rid, n in self.num_cached_blocks.items():
            blocks = self.req_blocks.get(rid, [])
            assert n <= len(blocks), f"{rid}: {n} blocks counted as cached, {len(blocks)} held"
        self.pool.check_invariants(owners)
