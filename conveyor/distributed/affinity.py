"""Which replica served which prompt heads, and the routing decisions built on it (pure Python, no Ray).

A prompt's head is named by the chained hashes of its leading full blocks, computed with the KV cache's own
``hash_block``: block i's hash names its tokens and every token before them, so "replica R saw hash h" means R
computed (and, unless evicted since, still caches) the whole prefix up to that block. The table remembers the
last time each replica saw each hash; it is bounded (least recently seen hashes go first) and ages (a sighting
older than ``ttl_s`` no longer counts: the replica's own LRU has likely evicted the block by then).

The decision (``choose_prefix``) is the one SGLang's router and Ray Serve LLM's ``PrefixCacheAffinityRouter``
make: while queue lengths stay within ``imbalance_threshold`` of each other, go to the replica holding the
longest prefix; when one queue runs ahead, or nothing matches, fall back to power of two choices. Time is passed
in, so tests drive it without a clock.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from conveyor.core.block_pool import BlockHash, hash_block

ReplicaKey = Hashable


def leading_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[BlockHash]:
    """Chained hashes of the first ``max_blocks`` full blocks of a prompt, exactly as the KV cache hashes them."""
    hashes: list[BlockHash] = []
    parent = None
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


class PrefixAffinity:
    """block hash -> {replica: last time it served a prompt with this block}, LRU-bounded to ``capacity``
    hashes, sightings valid for ``ttl_s``."""

    def __init__(self, capacity: int = 100_000, ttl_s: float = 600.0) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._seen: OrderedDict[BlockHash, dict[ReplicaKey, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def record(self, hashes: Sequence[BlockHash], replica: ReplicaKey, now: float) -> None:
        """``replica`` now holds these blocks (it was just sent the prompt)."""
        for h in hashes:
            sightings = self._seen.pop(h, None) or {}
            sightings[replica] = now
            self._seen[h] = sightings  # most recent at the end
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def matched_blocks(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaKey],
                       now: float) -> dict[ReplicaKey, int]:
        """For each replica, how many of the leading ``hashes`` it holds (a chain: the count stops at the first
        block it lacks)."""
        matched = {r: 0 for r in replicas}
        live = set(replicas)
        for h in hashes:
            sightings = self._seen.get(h)
            if not sightings:
                break
            live = {r for r in live if now - sightings.get(r, -float("inf")) <= self.ttl_s}
            if not live:
                break
            for r in live:
                matched[r] += 1
        return matched

    def forget(self, replica: ReplicaKey) -> None:
        """A replica died or left: its cache is gone."""
        for h in list(self._seen):
            sightings = self._seen[h]
            sightings.pop(replica, None)
            if not sightings:
                del self._seen[h]


@dataclass(frozen=True)
class Decision:
    """Replicas in order of preference (Ray Serve's ranks: the first rank that can take the request wins), and
    why: ``prefix`` (longest cached prefix), ``imbalanced`` (a queue ran ahead), ``no-match``."""

    ranks: list[list[ReplicaKey]]
    reason: str


def power_of_two(replicas: Sequence[ReplicaKey], queue_lens: dict[ReplicaKey, int],
                 rng: random.Random) -> list[ReplicaKey]:
    """Two random replicas, the shorter queue first (one when there is one)."""
    pair = rng.sample(list(replicas), min(2, len(replicas)))
    return sorted(pair, key=lambda r: queue_lens.get(r, 0))


def choose_prefix(matched: dict[ReplicaKey, int], queue_lens: dict[ReplicaKey, int], imbalance_threshold: int,
                  rng: random.Random) -> Decision:
    """Route to the replica with the longest cached prefix while queues are within ``imbalance_threshold``
    requests of each other (ties: the shorter queue); else power of two choices. ``matched`` names every
    candidate replica."""
    replicas = list(matched)
    fallback = power_of_two(replicas, queue_lens, rng)
    lens = [queue_lens.get(r, 0) for r in replicas]
    if max(lens) - min(lens) > imbalance_threshold:
        return Decision([fallback], "imbalanced")
    best = max(replicas, key=lambda r: (matched[r], -queue_lens.get(r, 0)))
    if matched[best] == 0:
        return Decision([fallback], "no-match")
    return Decision([[best], [r for r in fallback if r != best] or fallback], "prefix")
