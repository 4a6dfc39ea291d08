"""Request routers on Ray Serve's ``RequestRouter`` API, chosen with ``--router``.

They run inside the ingress process (in the deployment handle), once per request. ``prefix`` reads the prompt's
token ids from the request's arguments (``EngineReplica.generate(request_id, prompt, params)``), hashes its
leading blocks with the KV cache's ``hash_block`` and asks ``affinity.choose_prefix``; ``round-robin`` cycles;
``pow2`` is Ray Serve's default, its ``PowerOfTwoChoicesRequestRouter``.
"""

from __future__ import annotations

import itertools
import logging
import random
import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from conveyor.distributed.affinity import PrefixAffinity, choose_prefix, leading_block_hashes

logger = logging.getLogger("conveyor.distributed")


def prompt_token_ids(pending: PendingRequest | None) -> list[int] | None:
    """The prompt's token ids among a ``generate`` call's arguments (None for any other call)."""
    if pending is None or len(pending.args) < 2 or not isinstance(pending.args[1], dict):
        return None
    return pending.args[1].get("prompt_token_ids")


class PrefixAffinityRouter(RequestRouter):
    """Longest cached prefix while queues are balanced, else power of two choices (see ``affinity``).

    Queue lengths come from Ray Serve's per-replica queue-length cache (updated on every send and completion
    and by probes); replicas missing from it are probed."""

    def initialize_state(self, block_size: int = 16, max_blocks: int = 64, imbalance_threshold: int = 8,
                         capacity: int = 100_000, ttl_s: float = 600.0, seed: int | None = None) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.imbalance_threshold = imbalance_threshold
        self.affinity = PrefixAffinity(capacity, ttl_s)
        self.rng = random.Random(seed)
        self.decisions: dict[str, int] = {}  # reason -> count, for logs and tests

    def _hashes(self, pending: PendingRequest | None) -> list:
        ids = prompt_token_ids(pending)
        return leading_block_hashes(ids, self.block_size, self.max_blocks) if ids else []

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        lens: dict[ReplicaID, int] = {}
        missing = []
        for r in replicas:
            n = self.replica_queue_len_cache.get(r.replica_id)
            if n is None:
                missing.append(r)
            else:
                lens[r.replica_id] = n
        if missing:
            for r, n in await self._probe_queue_lens(missing, 0):
                if n is not None:
                    lens[r.replica_id] = n
        return lens

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        hashes = self._hashes(pending_request)
        lens = await self._queue_lens(candidate_replicas)
        matched = self.affinity.matched_blocks(hashes, list(by_id), time.monotonic())
        decision = choose_prefix(matched, lens, self.imbalance_threshold, self.rng)
        self.decisions[decision.reason] = self.decisions.get(decision.reason, 0) + 1
        return [[by_id[r] for r in rank] for rank in decision.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        hashes = self._hashes(pending_request)
        if hashes:
            self.affinity.record(hashes, replica_id, time.monotonic())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn (by replica id), whatever their queues."""

    def initialize_state(self, **_ignored) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        first = next(self._turn) % len(ordered)
        return [[r] for r in ordered[first:] + ordered[:first]]


ROUTERS = {
    "prefix": f"{__name__}.PrefixAffinityRouter",
    "pow2": None,  # Ray Serve's default, PowerOfTwoChoicesRequestRouter
    "round-robin": f"{__name__}.RoundRobinRouter",
}
