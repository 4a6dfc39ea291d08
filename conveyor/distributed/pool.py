"""``ReplicaPool``: the server's engine interface (``ServedEngine``) over a pool of Ray Serve replicas.

The OpenAI app (``conveyor.server.app.build_app``) runs unchanged in the ingress process; where a single server
hands a request to its engine, this hands it to the deployment handle, whose request router picks the
replica. The ingress holds no model: its ``info`` is a replica's ``EngineInfo`` with a tokenizer loaded here, so
prompts are tokenized here, where the prefix router can hash them. Streams, admission and drain are
``EngineClient``'s, as for a single engine.

    handler --add_request--> ReplicaPool --handle.generate (router picks)--> EngineReplica --> AsyncEngine
    RequestStream <--pump task-- ("accepted", id), RequestOutput, ... <--------------- streamed back

Faults: a replica that dies before it streamed a token is retried on another (``retries`` times); one that dies
mid-stream ends its requests with ``RequestFailedError`` (500 / an in-band SSE error). Nothing waits forever:
every stream ends with its final output or an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from conveyor.core.outputs import SchedulerStats
from conveyor.core.sampling_params import RequestOutputKind, SamplingParams
from conveyor.distributed.replica import ReplicaReport
from conveyor.engine.engine_client import (
    EngineClient, EngineDeadError, EngineInfo, Prepare, RequestFailedError, RequestStream,
)
from conveyor.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from conveyor.engine.prompts import PromptType

logger = logging.getLogger("conveyor.distributed")

REPLICA_LOST = (RayActorError, ActorDiedError, ActorUnavailableError)
POLL_PERIOD_S = 1.0
REPORT_STALE_S = 5.0
# How long a request may wait for a replica to accept it (routing plus the engine's add, normally milliseconds);
# past it the client gets a 503 instead of waiting on a deployment that has no replica to give.
ACCEPT_TIMEOUT_S = 60.0  # a replica that has not reported for this long is not counted live


def summed_stats(reports: list[ReplicaReport]) -> SchedulerStats:
    """The pool's stats: requests and counters summed, KV usage averaged (each replica has its own cache)."""
    if not reports:
        return SchedulerStats()
    stats = [r.stats for r in reports]
    return replace(stats[0], num_running=sum(s.num_running for s in stats),
                   num_waiting=sum(s.num_waiting for s in stats),
                   kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
                   num_preemptions=sum(s.num_preemptions for s in stats),
                   prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
                   prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
                   spec_num_drafts=sum(s.spec_num_drafts for s in stats),
                   spec_num_draft_tokens=sum(s.spec_num_draft_tokens for s in stats),
                   spec_num_accepted_tokens=sum(s.spec_num_accepted_tokens for s in stats),
                   spec_accepted_per_pos=summed_positions([s.spec_accepted_per_pos for s in stats]),
                   kv_evicted_blocks=sum(s.kv_evicted_blocks for s in stats))


def summed_positions(per_replica: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Accepted tokens by proposal position, summed over replicas whose proposals had different lengths."""
    width = max((len(p) for p in per_replica), default=0)
    return tuple(sum(p[i] for p in per_replica if i < len(p)) for i in range(width))


def aborted_output(request_id: str, prompt: dict, params: SamplingParams, stream: RequestStream) -> RequestOutput:
    """The final output of a request aborted here, as the engine's own abort reports it: every unfinished
    completion with finish_reason "abort", holding what it had produced (cumulative) or nothing more (deltas)."""
    last, delta = stream.last, params.output_kind is RequestOutputKind.DELTA
    if last is not None and not delta:
        return replace(last, outputs=[replace(c, finish_reason=c.finish_reason or "abort") for c in last.outputs],
                       finished=True)
    if last is None:
        last = RequestOutput(request_id, prompt.get("prompt"), prompt["prompt_token_ids"], [],
                             RequestMetrics(time.monotonic()))
    logprobs = [] if params.logprobs is not None else None
    ends = [CompletionOutput(i, logprobs=logprobs, finish_reason="abort", token_start=stream.num_tokens.get(i, 0))
            for i in range(params.n) if i not in stream.ended]
    return replace(last, outputs=ends, finished=True, delta=delta)


class ReplicaPool(EngineClient):
    """``ServedEngine`` served by the replicas of ``handle``'s deployment: ``build_app(pool)`` serves it as it
    serves one engine. ``info`` is what the replicas' engines share (``EngineReplica.info``), with a tokenizer
    loaded in this process. ``stats`` sums the replicas' latest reports.

    Streams, admission and ``drain`` are ``EngineClient``'s, as for one engine: in-flight requests get the
    deadline, then the rest are aborted and get ``DRAIN_ABORT_GRACE_S`` to end (an aborted request's pump ends
    its stream at once, so that wait is short). The pool never dies whole (Ray Serve replaces replicas), so ``on_dead`` is never called; nor are
    ``output_listeners`` and ``step_listeners``: the replicas count their own (``metrics.PoolMetrics``)."""

    def __init__(self, handle, info: EngineInfo, board, app_name: str, deployment_name: str,
                 retries: int = 2) -> None:
        super().__init__(SchedulerStats())
        self.handle = handle
        self.info = info
        self.board = board
        self.app_name, self.deployment_name = app_name, deployment_name
        self.retries = retries
        self.reports: list[ReplicaReport] = []  # live replicas' latest reports
        self.deployment_status: dict[str, Any] = {}
        self._pumps: dict[str, asyncio.Task] = {}  # request id -> the task copying its replica's stream
        self._poller: asyncio.Task | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._start_loop_side()
        self._poller = asyncio.ensure_future(self._poll_forever())

    @property
    def is_running(self) -> bool:
        """At least one replica reported recently."""
        return bool(self.reports)

    async def shutdown(self) -> None:
        """Abort whatever is left (``drain(0)``) and stop polling the replicas' reports."""
        await self.drain(0.0)
        if self._poller is not None:
            self._poller.cancel()

    def health(self) -> dict:
        """``/health``'s body: the replicas the ingress hears from, and the deployment as Ray Serve sees it."""
        return {"replicas": [{"id": r.replica_id, "running": r.stats.num_running, "waiting": r.stats.num_waiting,
                              "kv_cache_usage": r.stats.kv_cache_usage} for r in self.reports],
                "deployment": self.deployment_status}

    # ---- requests ---------------------------------------------------------------------------------------
    async def _add(self, request_id: str, prompt: PromptType | Prepare, params: SamplingParams,
                   arrival: float) -> None:
        """Tokenize here (a ``Prepare`` runs on a thread, with ``info``), then send to a replica. Raises what
        the replica's ``AsyncEngine.add_request`` raised, or EngineDeadError when no replica could take it."""
        if not self.reports:  # Ray Serve would hold the request until a replica is back: answer now instead
            raise EngineDeadError("no engine replica is running (Ray Serve is starting or replacing them)")
        # Tokenizing a long prompt takes a while: never on the event loop.
        engine_prompt = await asyncio.to_thread(prompt, self.info) if callable(prompt) else prompt
        if not isinstance(engine_prompt, dict):
            text, ids = self.info.tokenize_prompt(engine_prompt)
            engine_prompt = {"prompt": text, "prompt_token_ids": ids}
        responses = await self._send(request_id, engine_prompt, params)
        stream = self._streams[request_id]
        self._pumps[request_id] = asyncio.ensure_future(self._pump(stream, responses, engine_prompt, params))

    async def _send(self, request_id: str, prompt: dict, params: SamplingParams):
        """Start ``generate`` on a replica and wait for its verdict; a replica lost first is retried."""
        _, _, responses = await self._verdict(
            lambda: self.handle.options(stream=True).generate.remote(request_id, prompt, params), request_id)
        return responses

    async def _verdict(self, call, request_id: str, role: str = "") -> tuple[str, Any, Any]:
        """Start ``call()`` (a replica's streaming method) and wait for its first item, the replica's verdict; a
        replica lost first is retried (``retries`` times). Raises the replica's refusal, or ``EngineDeadError``
        when no replica took the request within ``ACCEPT_TIMEOUT_S``; returns (kind, value, the stream)."""
        who = f"{role} replica" if role else "replica"
        for attempt in range(self.retries + 1):
            responses = call()
            try:
                kind, value = await asyncio.wait_for(responses.__anext__(), ACCEPT_TIMEOUT_S)
            except asyncio.TimeoutError:
                responses.cancel()
                raise EngineDeadError(f"no {who} took request {request_id} within {ACCEPT_TIMEOUT_S:.0f} s") from None
            except REPLICA_LOST as exc:
                logger.warning("request %s: %s lost before it accepted (%r); attempt %d of %d", request_id, who, exc,
                               attempt + 1, self.retries + 1)
                continue
            except asyncio.CancelledError:
                responses.cancel()
                raise
            if kind == "rejected":
                raise value
            return kind, value, responses
        raise EngineDeadError(f"no {who} could take request {request_id} after {self.retries + 1} attempts")

    async def _pump(self, stream: RequestStream, responses, prompt: dict, params: SamplingParams) -> None:
        """Copy a replica's stream into ``stream``; retry on a new replica while nothing has been streamed."""
        request_id = stream.request_id
        retries_left = self.retries
        try:
            while True:
                try:
                    ended = False
                    async for item in responses:  # read to its end, so Ray Serve sees the call complete
                        if isinstance(item, tuple):  # ("failed", error)
                            stream.put(item[1])
                            ended = True
                            continue
                        stream.put(item)
                        ended = item.finished
                    if not ended:
                        stream.put(RequestFailedError(f"the replica's stream of {request_id} ended unfinished"))
                    return
                except REPLICA_LOST as exc:
                    if stream.num_generated_tokens == 0 and retries_left > 0:
                        retries_left -= 1
                        logger.warning("request %s: replica lost before its first token (%r); retrying",
                                       request_id, exc)
                        try:
                            responses = await self._send(request_id, prompt, params)
                        except Exception as send_exc:  # noqa: BLE001 - delivered to the stream's reader
                            stream.put(send_exc)
                            return
                        continue
                    stream.put(RequestFailedError(f"the replica serving this request died: {exc}"))
                    return
        except asyncio.CancelledError:  # aborted: the stream still ends, as the engine's own abort ends it
            responses.cancel()
            if stream.last is None or not stream.last.finished:
                stream.put(aborted_output(request_id, prompt, params, stream))
        finally:
            self._pumps.pop(request_id, None)
            self._forget(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel the request's stream: the replica aborts it (its blocks are freed) and the stream ends with
        finish_reason "abort". Before a replica accepted it there is nothing to cancel yet: ``add_request``
        forgets a request whose add was cancelled."""
        task = self._pumps.get(request_id)
        if task is not None:
            task.cancel()

    # ---- replicas' reports ------------------------------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - stale numbers for a second; the next poll tries again
                logger.warning("could not read the replicas' reports", exc_info=True)
            await asyncio.sleep(POLL_PERIOD_S)

    async def refresh(self) -> None:
        """Read the board and Ray Serve's view of the deployment."""
        posted = await self.board.read.remote()
        self.reports = sorted((r for age, r in posted if age <= REPORT_STALE_S), key=lambda r: r.replica_id)
        self.stats = summed_stats(self.reports)
        status = await asyncio.to_thread(serve.status)
        deployment = status.applications[self.app_name].deployments[self.deployment_name]
        self.deployment_status = {"status": getattr(deployment.status, "value", str(deployment.status)),
                                  "replica_states": {str(k): v for k, v in deployment.replica_states.items()}}
