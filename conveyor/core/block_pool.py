"""The pool of fixed-size KV blocks: ref counts, the LRU free list, and the prefix-cache table (SHA-256 keys).

Ordering rule (what gets evicted first): the free list is kept in eviction order, head first. A block whose
ref count drops to zero is appended at the tail if it carries a hash (a cached full block: least recently freed
is evicted first); allocation pops from the head, dropping the block's hash if it carried one. Requests free
their blocks tail-first (reverse block-table order), so a freed chain's *tail* blocks sit nearer the head and are
evicted before its prefix, which other requests are the likeliest to share. A block without a hash holds nothing
a later request can reuse, so it goes to the *head* instead: it is handed out before any cached block is evicted,
and the blocks in use stay the recently used ones (their memory already committed and likely still in the CPU's
cache) instead of walking the whole KV cache.
A cache hit on a free block unlinks it from the middle of the list in O(1) (intrusive doubly linked list).
That is the ``lru`` eviction policy (the default); ``--prefix-cache-eviction cost`` swaps the free list for the
cost-aware one of ``prefix_eviction`` (unhashed blocks still go first there).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from hashlib import sha256

from conveyor.core.prefix_eviction import PREFIX_EVICTION_POLICIES, CostAwareFreeBlocks

# A block's prefix-cache key: a SHA-256 digest (32 bytes). See hash_block and docs/prefix-cache-keys.md.
BlockHash = bytes


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` tokens hold ``a`` tokens."""
    return -(-a // b)


# The parent of a request's first block. A fixed value, not a per-process random one (vLLM's NONE_HASH): the
# same prompt then gets the same keys in every process (the prefix router and each replica hash prompts apart;
# the old hash() key did not even agree there, hash(None) being an address), and a secret seed is what a weak
# hash needs against crafted collisions, not SHA-256. The text versions the encoding: bump it when that changes.
ROOT_KEY: BlockHash = sha256(b"conveyor prefix-cache block key v1").digest()
_KEY_SIZE = len(ROOT_KEY)
# struct packers by block length, compiled once: one per block size in use (a 16-token key costs ~540 ns this
# way against ~715 ns with array('q').tobytes(), measured in docs/prefix-cache-keys.md).
_PACKERS: dict[int, Callable[..., bytes]] = {}


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained key of a full block: SHA-256 of (parent key, token ids), naming the block's tokens *and* every
    token before them. ``parent_hash`` is the previous block's key, None for a request's first block.

    A cache hit is trusted without comparing tokens, so two different blocks must never share a key: a collision
    would hand one request another's KV (a data leak between tenants). The key is therefore a cryptographic
    digest over an injective encoding: the parent key (always exactly 32 bytes) followed by every token id as a
    little-endian signed 64-bit integer. Fixed widths leave no ambiguity: the parent is the first 32 bytes, the
    token count is the remaining length / 8, and an id outside int64 raises (struct.error) instead of aliasing.
    Extra keys (a cache salt) must be appended framed (tag + length), not bare; a LoRA adapter's requests start
    from a root of their own (``core.lora_request.prefix_root``).
    Python's hash(), the old key, was 64 bits and not collision resistant: hash(0) == hash(2**61 - 1).
    """
    parent = ROOT_KEY if parent_hash is None else parent_hash
    if len(parent) != _KEY_SIZE:
        raise ValueError(f"parent key must be a {_KEY_SIZE}-byte block key, got {parent!r}")
    n = len(token_ids)
    pack = _PACKERS.get(n)
    if pack is None:
        pack = _PACKERS.setdefault(n, struct.Struct(f"<{n}q").pack)
    return sha256(parent + pack(*token_ids)).digest()


class KVBlock:
    """One block of ``block_size`` token slots. ``block_hash`` is set once, when the block is full."""

    __slots__ = ("block_id", "ref_cnt", "_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    @property
    def block_hash(self) -> BlockHash | None:
        return self._hash

    @block_hash.setter
    def block_hash(self, value: BlockHash) -> None:
        assert self._hash is None, f"block {self.block_id} already has a hash"
        self._hash = value

    def reset_hash(self) -> None:
        self._hash = None

    def __repr__(self) -> str:
        key = self._hash.hex()[:12] if isinstance(self._hash, bytes) else self._hash
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={key})"


class FreeBlockList:
    """Doubly linked list of free blocks in eviction order; O(1) pop-front, append at either end, remove."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head = KVBlock(-1)  # sentinels keep the pointer surgery branch-free
        self.tail = KVBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        assert self.tail.prev_free is not None
        self._link(block, self.tail.prev_free, self.tail)

    def appendleft(self, block: KVBlock) -> None:
        assert self.head.next_free is not None
        self._link(block, self.head, self.head.next_free)

    def _link(self, block: KVBlock, before: KVBlock, after: KVBlock) -> None:
        """Insert ``block`` between the adjacent ``before`` and ``after``."""
        before.next_free, block.prev_free = block, before
        block.next_free, after.prev_free = after, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next_free
        assert block is not None and block is not self.tail, "no free block"
        self.remove(block)
        return block

    def __iter__(self):
        block = self.head.next_free
        while block is not self.tail:
            assert block is not None
            yield block
            block = block.next_free

    # The eviction-policy hooks (see prefix_eviction): LRU's order is the list itself, so it keeps no score.
    def on_hit(self, block: KVBlock) -> None:
        pass

    def on_cached(self, block: KVBlock, parent: KVBlock | None, position: int) -> None:
        pass

    def on_evicted(self, block: KVBlock) -> None:
        pass

    def on_reset(self) -> None:
        pass

    def check_invariants(self, blocks: list[KVBlock], cached: dict) -> None:
        pass


def make_free_blocks(policy: str, blocks: list[KVBlock]) -> FreeBlockList | CostAwareFreeBlocks:
    """The free-block structure that implements eviction policy ``policy`` (``PREFIX_EVICTION_POLICIES``)."""
    if policy == "lru":
        return FreeBlockList(blocks)
    if policy == "cost":
        return CostAwareFreeBlocks(FreeBlockList(blocks), len(blocks))
    raise ValueError(f"prefix_cache_eviction must be one of {', '.join(PREFIX_EVICTION_POLICIES)}, got {policy!r}")


class BlockPool:
    """``num_blocks`` blocks, their ref counts, and the hash -> block table of cached full blocks.

    ``eviction`` names the order in which cached free blocks are given up (``lru``, ``cost``: prefix_eviction)."""

    def __init__(self, num_blocks: int, eviction: str = "lru") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.eviction = eviction
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_list = make_free_blocks(eviction, self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_list.num_free

    def usage(self) -> float:
        """Fraction of blocks referenced by some request (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block with this key, or None. A hit is trusted as is, without comparing tokens."""
        # Why no token compare (docs/prefix-cache-keys.md has the numbers): keys are SHA-256 over an injective
        # encoding, so two blocks share one only through a SHA-256 collision (about 2^-177 after 2^40 blocks).
        # Nor would a compare be a sound second line: keys chain, so a collision one level up plus equal tokens in
        # this block passes it; a sound check needs the parent *block* as well, and caching rules that change which
        # blocks get cached. Its price here: a token tuple per cached block (168 B, plus up to 448 B of int objects
        # once the owning request is gone) and about 85 ns per hit block. vLLM trusts its SHA-256 keys the same way.
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free list (evicting their cached hashes). Caller checks room."""
        assert n <= self.num_free_blocks, f"asked {n} blocks, {self.num_free_blocks} free"
        out = []
        for _ in range(n):
            block = self.free_list.popleft()
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.reset_hash()
                self.num_evictions += 1
                self.free_list.on_evicted(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_list.remove(block)
            block.ref_cnt += 1
            self.free_list.on_hit(block)

    def free(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free list: cached ones at the tail in the given
        order, unhashed ones at the head (reused first: see the module's ordering rule)."""
        for block in blocks_in_eviction_order:
            assert block.ref_cnt > 0, f"{block} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_list.appendleft(block)
                else:
                    self.free_list.append(block)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash | None = None,
                         position: int = 0) -> None:
        """Make a full block findable by its hash (first writer wins; a duplicate stays unhashed).

        ``parent_hash`` (the key before it in its chain, None for a first block) and ``position`` (its index in
        the chain) tell the eviction policy where the block sits: the holder of the parent key is the block whose
        eviction would make this one unreachable."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            parent = None if parent_hash is None else self.cached.get(parent_hash)
            self.free_list.on_cached(block, parent, position)

    def uncache_block(self, block: KVBlock) -> None:
        """Make a held cached block unfindable again (its KV was never computed: a step cut short)."""
        assert block.ref_cnt > 0, f"{block} is free: its place in the free list follows its hash"
        assert self.cached.get(block.block_hash) is block, f"{block} is not the cached block of its hash"
        del self.cached[block.block_hash]
        block.reset_hash()
        self.free_list.on_evicted(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after a weight reload)."""
        for block in self.cached.values():
            block.reset_hash()
        self.cached.clear()
        self.free_list.on_reset()

    def check_invariants(self, owners: dict[int, int]) -> None:
        """Raise AssertionError unless the pool is consistent. ``owners``: block id -> number of owning requests."""
        free_ids = [b.block_id for b in self.free_list]
        assert len(free_ids) == len(set(free_ids)) == self.num_free_blocks, "free list corrupt or has duplicates"
        free_set = set(free_ids)
        for block in self.blocks:
            expected = owners.get(block.block_id, 0)
            assert block.ref_cnt == expected, f"{block}: ref count {block.ref_cnt} != {expected} owners"
            assert (block.ref_cnt == 0) == (block.block_id in free_set), f"{block}: free list membership wrong"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"{block}: hashed but not findable"
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert used + self.num_free_blocks == self.num_blocks, "free + used != total"
        assert all(b.block_hash == h for h, b in self.cached.items()), "hash table points at a re-hashed block"
        self.free_list.check_invariants(self.blocks, self.cached)
