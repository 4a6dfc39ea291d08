"""One conveyor engine as a Ray Serve replica, and the board where replicas post their numbers.

``EngineReplica`` hosts an ``AsyncEngine`` (the engine in a thread, as ``conveyor serve --engine-in-process``
runs it) and its own ``ServerMetrics``. The ingress talks to it through one streaming method, ``generate``;
everything the OpenAI API does (validation, formatting, SSE, usage) stays in the ingress's ``conveyor.server``
code.

Replicas cannot be addressed one by one through a deployment handle (the router picks), so each posts a report
(stats snapshot, token totals, rendered Prometheus metrics) to a ``ReplicaBoard`` actor every
``REPORT_PERIOD_S``; the ingress reads the board for ``/metrics``, ``/health`` and the status line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass

import ray
from ray import serve

from conveyor.core.outputs import SchedulerStats
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.engine_client import EngineInfo

logger = logging.getLogger("conveyor.distributed")

REPORT_PERIOD_S = 1.0
CLAIM_STALE_S = 10.0  # a replica silent this long has let go of its CPUs


@dataclass(frozen=True)
class ReplicaReport:
    """What one replica posts: its engine's stats snapshot, token totals and rendered metrics."""

    replica_id: str
    stats: SchedulerStats
    prompt_tokens: int
    generation_tokens: int
    metrics_text: bytes


@ray.remote(num_cpus=0)
class ReplicaBoard:
    """The latest report of every replica, with its age (seconds since it was posted); and, for disaggregated
    serving, the hand-offs whose KV a prefill replica may let go (``release``), handed back at its next post."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, ReplicaReport]] = {}
        self._released: dict[str, list[str]] = {}
        self._claims: dict[str, list[int]] = {}  # replica id -> the CPUs it computes on (claim_cpus)

    def post(self, report: ReplicaReport) -> list[str]:
        """Record ``report``; return the request ids released to this replica since its last post."""
        self._reports[report.replica_id] = (time.monotonic(), report)
        return self._released.pop(report.replica_id, [])

    def release(self, replica_id: str, request_id: str) -> None:
        """The KV that ``replica_id`` holds for ``request_id`` is no longer needed (fetched, or abandoned)."""
        self._released.setdefault(replica_id, []).append(request_id)

    def claim_cpus(self, replica_id: str, allowed: list[int], count: int) -> list[int]:
        """``count`` of the ``allowed`` CPUs for ``replica_id``, the least claimed first: claims of replicas that
        stopped reporting (dead, replaced) no longer count."""
        now = time.monotonic()
        live = {rid for rid, (t, _) in self._reports.items() if now - t <= CLAIM_STALE_S}
        self._claims = {rid: c for rid, c in self._claims.items() if rid in live or rid not in self._reports}
        load = {cpu: 0 for cpu in allowed}
        for claimed in self._claims.values():
            for cpu in claimed:
                if cpu in load:
                    load[cpu] += 1
        cpus = sorted(allowed, key=lambda cpu: (load[cpu], cpu))[:max(1, count)]
        self._claims[replica_id] = cpus
        return cpus

    def read(self) -> list[tuple[float, ReplicaReport]]:
        now = time.monotonic()
        return [(now - t, r) for t, r in self._reports.values()]


class EngineReplica:
    """A Ray Serve deployment class: one ``LLMEngine`` in an ``AsyncEngine``, built from ``EngineArgs``."""

    async def __init__(self, args: EngineArgs, model_name: str | None, torch_threads: int, board,
                       pin_cpus: bool = False) -> None:
        """``pin_cpus``: compute on ``torch_threads`` CPUs of this machine that no other live replica claimed
        (``ReplicaBoard.claim_cpus``, then the engine's own ``cpu_ids``), so that replicas on one machine do not
        share cores; Ray's ``num_cpus`` only counts CPUs, it does not place them."""
        import dataclasses
        import os

        import torch

        from conveyor.engine.async_engine import AsyncEngine
        from conveyor.engine.llm_engine import LLMEngine
        from conveyor.server.metrics import ServerMetrics

        torch.set_num_threads(torch_threads)  # the replica's CPU share, not the machine's core count
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        if pin_cpus:
            cpus = await board.claim_cpus.remote(self.replica_id, sorted(os.sched_getaffinity(0)), torch_threads)
            args = dataclasses.replace(args, cpu_ids=",".join(map(str, cpus)))
            logger.warning("replica %s computes on CPUs %s", self.replica_id, cpus)
        self.engine = LLMEngine(args)
        self.async_engine = AsyncEngine(self.engine)
        self.metrics = ServerMetrics(self.async_engine, model_name or self.engine.model_info.name)
        self.metrics.attach()
        self.async_engine.start()
        self._board = board
        self._reporter = asyncio.create_task(self._report_forever())

    def info(self) -> EngineInfo:
        """The engine's facts, for an ingress without a model (``pool.ReplicaPool.info``); the ingress loads its
        own tokenizer (``EngineInfo.loaded``)."""
        return self.engine.info.portable(with_tokenizer=False)

    async def generate(self, request_id: str, prompt: dict, params: SamplingParams):
        """Stream one request: first ``("accepted", replica id)`` or ``("rejected", error)`` (what
        ``AsyncEngine.add_request`` raised), then every ``RequestOutput``; a request that fails on the way ends
        with ``("failed", error)``. A cancelled stream (the client left) aborts the request."""
        async with aclosing(self._streamed(request_id, self.async_engine.add_request(request_id, prompt, params),
                                          lambda out: out)) as items:
            async for item in items:
                yield item

    async def _streamed(self, request_id: str, started, emit):
        """The stream protocol every replica method speaks (``generate`` above): ``started`` (the engine's
        add-request coroutine) raising is ``("rejected", error)``, else ``("accepted", replica id)``, then
        ``emit(output)`` for every output, ``("failed", error)`` for an error on the way; a stream closed or
        cancelled before its request finished aborts it here. Callers hold it in ``aclosing``, so that a
        cancelled caller closes it at once (an abandoned async generator runs its ``finally`` only when
        collected)."""
        try:
            stream = await started
        except Exception as exc:  # noqa: BLE001 - the ingress re-raises it and maps it to a status
            yield ("rejected", exc)
            return
        yield ("accepted", self.replica_id)
        finished = False
        try:
            async for out in stream:
                finished = out.finished
                yield emit(out)
        except Exception as exc:  # noqa: BLE001 - RequestFailedError / EngineDeadError, delivered in-band
            finished = True
            yield ("failed", exc)
        finally:
            if not finished:
                self.async_engine.abort(request_id)

    async def check_health(self) -> None:
        """Ray Serve calls this periodically; a replica whose engine thread died is replaced."""
        if not self.async_engine.is_running:
            raise RuntimeError(f"the engine of replica {self.replica_id} is not running: "
                               f"{self.async_engine.dead_error!r}")

    def report(self) -> ReplicaReport:
        return ReplicaReport(self.replica_id, self.async_engine.stats, self.metrics.total_prompt_tokens,
                             self.metrics.total_generation_tokens, self.metrics.render())

    def on_released(self, request_ids: list[str]) -> None:
        """Hand-offs released on the board (``ReplicaBoard.release``): only prefill replicas hold any."""

    async def _report_forever(self) -> None:
        while True:
            try:
                self.on_released(await self._board.post.remote(self.report()))
            except Exception:  # noqa: BLE001 - a missed report only ages this replica's numbers
                logger.warning("replica %s could not post its report", self.replica_id, exc_info=True)
            await asyncio.sleep(REPORT_PERIOD_S)
