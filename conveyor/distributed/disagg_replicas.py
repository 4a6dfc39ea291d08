"""The two kinds of replica of a disaggregated deployment (``--disaggregate xPyD``): prefill and decode.

Both are ``EngineReplica``s (an ``AsyncEngine``, its metrics, its reports on the board). A prefill replica runs
a request to its first token and streams back that output and a reference to its ``KVHandoff``, which it put in
Ray's object store (``ray.put``: the replica owns the object; the reference travels through the ingress, which
never touches the bytes, to a decode replica, which reads them from the node's shared-memory store without a
copy and copies them into its KV cache). ``scripts/kv_transfer_bench.py`` measured this against sending the
bytes by value through the ingress and against a POSIX shared-memory segment (docs/disaggregation.md).

Ray counts references to the object, but one that crosses a Serve stream is not reliably counted as borrowed
(a fetch failed with "already deleted by the reference counting protocol" once the prefill replica dropped its
own): so the prefill replica keeps each reference in an outbox until the ingress releases it on the board
(``ReplicaBoard.release``: once the decode replica streamed past the first token, or the request was abandoned),
and at most ``HOLD_S``.

A decode replica imports the hand-off and streams the rest; it also serves whole the requests that are not
handed over (``engine.kv_handoff.can_hand_off``: n > 1, structured outputs), through the inherited ``generate``.

Faults are bounded: the decode replica waits at most ``FETCH_TIMEOUT_S`` for the KV (the prefill replica that
owns it may have died: Ray raises at once, ``OwnerDiedError``) and then answers ``("lost", error)``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import aclosing

import ray

from conveyor.core.sampling_params import SamplingParams
from conveyor.distributed.replica import EngineReplica

FETCH_TIMEOUT_S = 60.0  # the KV is on this machine's store, or its owner's node: milliseconds unless lost
HOLD_S = 300.0  # a hand-off never released (its ingress died) is dropped after this long


class PrefillReplica(EngineReplica):
    """Prefill only: ``prefill`` streams a request up to its first token and hands its KV over."""

    async def __init__(self, *args, pin_cpus: bool = False) -> None:
        await super().__init__(*args, pin_cpus=pin_cpus)
        self._outbox: dict[str, tuple[float, object]] = {}  # request id -> (when put, reference to its KV)

    def on_released(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._outbox.pop(rid, None)
        stale = time.monotonic() - HOLD_S
        for rid in [rid for rid, (t, _) in self._outbox.items() if t < stale]:
            del self._outbox[rid]

    def num_held(self) -> int:
        """Hand-offs whose KV this replica still holds for a decode replica (tests: back to 0)."""
        return len(self._outbox)

    async def prefill(self, request_id: str, prompt: dict, params: SamplingParams):
        """First ``("accepted", replica id)`` or ``("rejected", error)``; then either ``("handoff", output,
        [kv reference], replica id)`` (output: the first token, not finished; the reference is held here until
        released on the board under this replica id) or, for a request that ended at its first
        token, its final ``RequestOutput``; ``("failed", error)`` when it fails on the way. A cancelled stream
        aborts the request (its blocks are freed)."""
        def emit(out):
            if out.kv_handoff is None:
                return out
            # In a list: Ray passes a nested reference as a reference (a top-level one would be fetched).
            ref = ray.put(out.kv_handoff)
            self._outbox[request_id] = (time.monotonic(), ref)
            return ("handoff", dataclasses.replace(out, finished=False, kv_handoff=None), [ref], self.replica_id)

        started = self.async_engine.add_prefill_request(request_id, prompt, params)
        async with aclosing(self._streamed(request_id, started, emit)) as items:
            async for item in items:
                yield item


class DecodeReplica(EngineReplica):
    """Decode: ``decode`` continues a handed-over request; ``generate`` (inherited) serves a request whole.

    ``prefill`` is the prefill deployment, bound here only so that both deployments form one Serve application
    (deployed and deleted together); requests reach it through the ingress's own handle."""

    async def __init__(self, *args, prefill=None, pin_cpus: bool = False) -> None:
        await super().__init__(*args, pin_cpus=pin_cpus)
        self.fetch_delay_s = 0.0

    def set_fetch_delay(self, seconds: float) -> None:
        """Tests only: wait this long before fetching each hand-off's KV, a window in which a test kills a
        replica mid-transfer."""
        self.fetch_delay_s = seconds

    async def decode(self, request_id: str, kv_refs: list):
        """First ``("accepted", replica id)``, ``("rejected", error)`` (the engine refused it: a full queue), or
        ``("lost", error)`` (its KV could not be fetched in ``FETCH_TIMEOUT_S``); then every ``RequestOutput``
        (cumulative from the first token); ``("failed", error)`` when it fails on the way. A cancelled stream
        aborts the request (its blocks are freed)."""
        try:
            if self.fetch_delay_s:
                await asyncio.sleep(self.fetch_delay_s)
            handoff = await asyncio.wait_for(kv_refs[0], FETCH_TIMEOUT_S)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            yield ("lost", exc)
            return
        self.metrics.note_handed_over(request_id)  # before the add: its first output may come at once
        started = self.async_engine.add_handoff(handoff)
        del handoff, kv_refs  # copied into the cache at admission; the engine holds it until then
        async with aclosing(self._streamed(request_id, started, lambda out: out)) as items:
            async for item in items:
                yield item
