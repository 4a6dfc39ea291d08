"""``DisaggPool``: the server's engine interface over a disaggregated deployment, prefill and decode replicas.

    handler --add_request--> DisaggPool --prefill (prefix router)--> PrefillReplica: prompt KV, first token
        RequestStream <--first token-- ("handoff", output, [kv ref]) <--+   (the KV stays in Ray's object store)
        DisaggPool --decode(kv ref) (pow2)--> DecodeReplica: copies the KV into its cache, decodes
        RequestStream <--cumulative outputs-- ... <--------------------+

The first token reaches the client as soon as the prefill replica sampled it; only a reference to the KV passes
through this process. Requests that are not handed over (``engine.kv_handoff.can_hand_off``) go whole to a decode
replica, as ``ReplicaPool`` sends them. Everything else (streams, admission, drain, reports on the board,
``/metrics``, ``/health``) is ``ReplicaPool``'s.

Faults, each bounded (every wait has a timeout; a dead replica's call fails at once with ``REPLICA_LOST``):
- a prefill replica lost before the first token reached the client: retried on another (``retries`` times);
  after it, the request ends with ``RequestFailedError`` if its KV can no longer be fetched (the prefill replica
  owned it), as a request whose replica died mid-stream does in ``ReplicaPool``;
- a decode replica lost before it streamed a token: the same KV is sent to another (it is still in the store);
  after, ``RequestFailedError``;
- a stream that produces nothing for ``STREAM_STALL_S``: ``RequestFailedError`` (a hang guard, not a budget).
An abort cancels whichever call is in flight, and the replica's engine frees that request's blocks. The KV
reference is released on the board (``disagg_replicas``' outbox) once the decode replica streamed past the first
token, or when the request ends any other way.
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from conveyor.core.sampling_params import SamplingParams
from conveyor.distributed.pool import (
    REPLICA_LOST, REPORT_STALE_S, ReplicaPool, aborted_output, summed_stats,
)
from conveyor.engine.engine_client import EngineDeadError, RequestFailedError, RequestStream
from conveyor.engine.kv_handoff import can_hand_off

logger = logging.getLogger("conveyor.distributed")

STREAM_STALL_S = 300.0  # no item from a replica's stream for this long: give up on it (a hang guard)


class KVLostError(RequestFailedError):
    """A hand-off's KV could not be fetched by the decode replica (its prefill replica died)."""


class _Stalled(Exception):
    pass


async def _items(responses, stall_s: float = STREAM_STALL_S):
    """A replica's stream item by item, each within ``stall_s`` (else ``_Stalled``)."""
    while True:
        try:
            item = await asyncio.wait_for(responses.__anext__(), stall_s)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            responses.cancel()
            raise _Stalled(f"no news from the replica for {stall_s:.0f} s") from None
        yield item


class DisaggPool(ReplicaPool):
    """``ServedEngine`` over ``prefill_handle``'s and ``handle``'s (decode) replicas (see the module doc)."""

    def __init__(self, prefill_handle, decode_handle, info, board, app_name: str, prefill_name: str,
                 decode_name: str, retries: int = 2) -> None:
        super().__init__(decode_handle, info, board, app_name, decode_name, retries)
        self.prefill_handle = prefill_handle
        self.prefill_name = prefill_name
        self.num_handed_over = 0  # requests whose KV reached a decode replica
        self.num_kv_lost = 0

    async def _add(self, request_id: str, prompt, params: SamplingParams, arrival: float) -> None:
        if not can_hand_off(params):
            return await super()._add(request_id, prompt, params, arrival)  # whole, on a decode replica
        if not self.reports:
            raise EngineDeadError("no engine replica is running (Ray Serve is starting or replacing them)")
        engine_prompt = await asyncio.to_thread(prompt, self.info) if callable(prompt) else prompt
        if not isinstance(engine_prompt, dict):
            text, ids = self.info.tokenize_prompt(engine_prompt)
            engine_prompt = {"prompt": text, "prompt_token_ids": ids}
        responses = await self._accepted(lambda: self.prefill_handle.options(stream=True).prefill.remote(
            request_id, engine_prompt, params), request_id, "prefill")
        stream = self._streams[request_id]
        self._pumps[request_id] = asyncio.ensure_future(self._run(stream, responses, engine_prompt, params))

    async def _accepted(self, call, request_id: str, role: str):
        """``ReplicaPool._verdict`` of ``call()``; a decode replica's "lost" (the KV could not be fetched) raises
        ``KVLostError``."""
        kind, value, responses = await self._verdict(call, request_id, role)
        if kind == "lost":
            self.num_kv_lost += 1
            raise KVLostError(f"the KV of request {request_id} was lost in transfer: {value}")
        return responses

    async def _run(self, stream: RequestStream, responses, prompt: dict, params: SamplingParams) -> None:
        """Prefill, hand over, decode: copy both replicas' streams into ``stream``; every path ends it."""
        request_id = stream.request_id
        state = {"responses": responses}
        try:
            kv_refs = await self._prefill(stream, prompt, params, state)
            if kv_refs is not None:
                await self._decode(stream, kv_refs, state)
        except (RequestFailedError, EngineDeadError) as exc:
            stream.put(exc)
        except asyncio.CancelledError:  # aborted: the stream still ends, as the engine's own abort ends it
            state["responses"].cancel()
            if stream.last is None or not stream.last.finished:
                stream.put(aborted_output(request_id, prompt, params, stream))
        finally:
            self._release(request_id, state)
            self._pumps.pop(request_id, None)
            self._forget(request_id)

    def _release(self, request_id: str, state: dict) -> None:
        """Tell the prefill replica holding this request's KV to let it go (once; fire and forget)."""
        holder = state.pop("holder", None)
        if holder is not None:
            self.board.release.remote(holder, request_id)

    async def _prefill(self, stream: RequestStream, prompt: dict, params: SamplingParams, state: dict):
        """The prefill replica's stream: the first token to the client; returns the KV references (None when
        the request ended there)."""
        request_id = stream.request_id
        retries_left = self.retries
        while True:
            kv_refs = None
            try:
                async for item in _items(state["responses"]):  # to its end: the replica then drops its reference
                    if isinstance(item, tuple) and item[0] == "failed":
                        raise RequestFailedError(str(item[1]))
                    if isinstance(item, tuple):  # ("handoff", first-token output, [kv ref], holder)
                        _, out, kv_refs, state["holder"] = item
                    else:
                        out = item
                    stream.put(out)
                if kv_refs is None and not (stream.last and stream.last.finished):
                    raise RequestFailedError(f"the prefill replica's stream of {request_id} ended unfinished")
                return kv_refs
            except (*REPLICA_LOST, _Stalled) as exc:
                if stream.last is None and retries_left > 0:
                    retries_left -= 1
                    logger.warning("request %s: prefill replica lost before the first token (%r); retrying",
                                   request_id, exc)
                    state["responses"] = await self._accepted(
                        lambda: self.prefill_handle.options(stream=True).prefill.remote(request_id, prompt, params),
                        request_id, "prefill")
                    continue
                if kv_refs is not None:  # lost after the hand-off was sent: the decode side may still fetch it
                    return kv_refs
                raise RequestFailedError(f"the prefill replica serving this request died: {exc}") from None

    async def _decode(self, stream: RequestStream, kv_refs: list, state: dict) -> None:
        """Send the KV reference to a decode replica and copy its stream; a decode replica lost before it
        streamed a token is replaced by another with the same reference."""
        request_id = stream.request_id
        for attempt in range(self.retries + 1):
            state["responses"] = await self._accepted(
                lambda: self.handle.options(stream=True).decode.remote(request_id, kv_refs), request_id, "decode")
            self.num_handed_over += 1
            streamed = False
            try:
                async for item in _items(state["responses"]):
                    if isinstance(item, tuple):  # ("failed", error)
                        raise RequestFailedError(str(item[1]))
                    if item.num_generated_tokens > 1 and not streamed:  # past the first token, whatever the kind
                        streamed = True  # no retry from here on: the KV may go
                        self._release(request_id, state)
                    stream.put(item)
                if not (stream.last and stream.last.finished):
                    raise RequestFailedError(f"the decode replica's stream of {request_id} ended unfinished")
                return
            except (*REPLICA_LOST, _Stalled) as exc:
                if streamed or attempt == self.retries:
                    raise RequestFailedError(f"the decode replica serving this request died: {exc}") from None
                logger.warning("request %s: decode replica lost before its second token (%r); retrying",
                               request_id, exc)

    async def refresh(self) -> None:
        """The board, and both deployments as Ray Serve sees them."""
        posted = await self.board.read.remote()
        self.reports = sorted((r for age, r in posted if age <= REPORT_STALE_S), key=lambda r: r.replica_id)
        self.stats = summed_stats(self.reports)
        status = await asyncio.to_thread(serve.status)
        deployments = status.applications[self.app_name].deployments
        self.deployment_status = {
            name: {"status": getattr(d.status, "value", str(d.status)),
                   "replica_states": {str(k): v for k, v in d.replica_states.items()}}
            for name, d in deployments.items() if name in (self.prefill_name, self.deployment_name)}
