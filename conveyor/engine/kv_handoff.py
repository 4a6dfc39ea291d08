"""Disaggregated prefill / decode at the engine level: a request's prompt KV handed from one engine to another.

The prefill side (``LLMEngine.add_prefill_request``) runs a request until its first token is sampled, then
exports what the decode side needs to go on as if it had computed the prompt itself: the prompt's K/V (every
layer, ``runner.kv_io``'s per-token wire form), the token ids, the first token (and its logprobs), the sampling
params and the seeded generator's state. Its blocks are freed in the same step. A request that finishes at its
first token (EOS, a stop string, ``max_tokens=1``) needs no decode side and ends there as usual.

The decode side (``LLMEngine.add_handoff``) queues the request with ``num_computed_tokens`` = prompt length and
the first token in its output: the scheduler's hand-over path admits it as a one-token decode, allocating blocks
for every token; between that ``schedule`` and the step's ``execute`` the engine writes the K/V into those blocks
(``KVHandoffs.write_admitted``, through the executor's ``core.interfaces.KVTransfer``). A request aborted before
it is admitted leaves nothing behind; a preempted one recomputes its prompt here, as any preempted request does.

Nothing here needs Ray: ``KVHandoff`` is plain data (the K/V as a numpy byte array, which Ray's object store
and pickle carry without copies), and ``distributed.disagg`` moves it between replicas.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from conveyor.core.interfaces import KVManager, KVTransfer
from conveyor.core.outputs import SchedulerOutput, TokenLogprobs
from conveyor.core.request import Request, RequestStatus
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler
from conveyor.engine.outputs import RequestOutput


@dataclass
class KVHandoff:
    """Everything a decode engine needs to continue a request that a prefill engine started."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    sampling_params: SamplingParams
    kv_bytes: np.ndarray  # uint8, the wire-form tensor's bytes
    kv_shape: tuple[int, ...]  # [layers, 2, prompt tokens, kv heads, head dim]
    kv_dtype: str  # torch dtype name, e.g. "float32"
    generator_state: np.ndarray | None = None  # uint8: the seeded generator after the first draw
    num_cached_tokens: int = 0  # prompt tokens the prefill side's prefix cache served
    timings: dict[str, float] = field(default_factory=dict)  # monotonic s: arrival, first_token, exported

    @property
    def num_bytes(self) -> int:
        return int(self.kv_bytes.nbytes)

    @classmethod
    def pack(cls, kv: torch.Tensor, generator_state: torch.Tensor | None, **fields) -> KVHandoff:
        kv = kv.contiguous()
        raw = kv.view(torch.uint8)
        gen = generator_state.numpy().copy() if generator_state is not None else None
        return cls(kv_bytes=raw.reshape(-1).numpy(), kv_shape=tuple(kv.shape),
                   kv_dtype=str(kv.dtype).removeprefix("torch."), generator_state=gen, **fields)

    def kv(self) -> torch.Tensor:
        """The wire-form K/V tensor (a view of ``kv_bytes``, which may be read-only: it is only read)."""
        with warnings.catch_warnings():  # a read-only buffer out of Ray's object store: copied into the cache
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self.kv_bytes)
        return raw.view(getattr(torch, self.kv_dtype)).reshape(self.kv_shape)

    def generator(self) -> torch.Tensor | None:
        return None if self.generator_state is None else torch.from_numpy(self.generator_state.copy())


def can_hand_off(params: SamplingParams) -> bool:
    """Whether a request can be split into prefill here and decode elsewhere: not ``n > 1`` (its completions
    share the prompt's blocks), constrained (its grammar state lives here) or with prompt logprobs (the final
    output carries them, and only the prefill side has them); serve those whole."""
    return params.n == 1 and params.structured_outputs is None and params.prompt_logprobs is None


class KVHandoffs:
    """An engine's requests in hand-over, and the two points of a step they need: prefill-only ones, exported at
    their first token (``export_first_tokens``, after output processing), and handed-over ones, whose K/V is
    written into the blocks the schedule that admits them gave (``write_admitted``, before the executor runs).

    Its dependencies are explicit: the engine's ``scheduler`` (its requests, and finishing an exported one), the
    executor's ``KVTransfer`` (the copies) and the ``KVManager`` (a request's block table)."""

    def __init__(self, scheduler: Scheduler, transfer: KVTransfer, kv_manager: KVManager) -> None:
        self.scheduler, self.transfer, self.kv_manager = scheduler, transfer, kv_manager
        self.exporting: set[str] = set()
        self.importing: dict[str, KVHandoff] = {}

    def check(self, params: SamplingParams) -> None:
        """ValueError unless a request with ``params`` can be handed over by this engine: ``can_hand_off``, and an
        exact cache (a table that KV eviction has cut no longer holds every prompt token, nor at its slot)."""
        if self.scheduler.evictor is not None:
            raise ValueError("the KV hand-over needs the exact cache: it does not run with --kv-eviction "
                             f"{self.scheduler.evictor.config.policy}")
        if not can_hand_off(params):
            raise ValueError("n > 1, structured outputs and prompt logprobs are not handed over: serve the request "
                             "whole")

    def admit(self, handoff: KVHandoff, request: Request) -> None:
        """Queue the decode side's ``request`` (``decode_request``); its K/V is written when it is admitted."""
        self.scheduler.add_request(request)
        self.importing[request.request_id] = handoff

    def drop(self, request_ids) -> None:
        """Aborted (or failed): forget them on both counts."""
        for rid in request_ids:
            self.exporting.discard(rid)
            self.importing.pop(rid, None)

    def __len__(self) -> int:
        return len(self.exporting) + len(self.importing)

    def export_first_tokens(self, states: list[RequestOutput]) -> None:
        """Prefill-only requests that sampled their first token this step: export their KV, free their blocks, and
        turn their state (before ``OutputProcessor.emit``) into their last output, carrying the hand-off
        (``RequestOutput.kv_handoff``)."""
        now = time.monotonic()
        scheduler = self.scheduler
        for out in states:
            rid = out.request_id
            if rid not in self.exporting:
                continue
            request = scheduler.requests.get(rid)
            if out.finished or request is None:  # ended at its first token (EOS, stop string, max_tokens=1)
                self.exporting.discard(rid)
                continue
            if request.num_output_tokens == 0:
                continue
            kv, gen = self.transfer.export_kv(rid, self.kv_manager.block_ids(rid), request.num_prompt_tokens)
            comp = out.outputs[0]
            out.kv_handoff = KVHandoff.pack(
                kv, gen, request_id=rid, prompt=out.prompt, prompt_token_ids=list(request.prompt_token_ids),
                first_token_id=request.output_token_ids[0],
                first_logprobs=comp.logprobs[0] if comp.logprobs else None, sampling_params=request.sampling_params,
                num_cached_tokens=request.num_cached_prompt_tokens,
                timings={"arrival": request.times.arrival, "first_token": request.times.first_token or now,
                         "exported": time.monotonic()})
            self.exporting.discard(rid)
            scheduler.finish_request(rid, RequestStatus.FINISHED_LENGTH, now)  # its blocks are free now
            out.finished = True  # its last output here: the output processor forgets it

    def write_admitted(self, sched_out: SchedulerOutput) -> None:
        """Write the K/V of the handed-over requests this schedule admitted into their new blocks, before the step
        that first reads them."""
        for new in sched_out.scheduled_new_reqs:
            h = self.importing.pop(new.request_id, None)
            if h is not None:
                assert new.num_computed_tokens == len(h.prompt_token_ids), "a hand-over admitted as a prefill"
                self.transfer.import_kv(new.request_id, new.block_ids, h.kv(), h.generator())


def check_fits(h: KVHandoff, model_info) -> None:
    """ValueError unless ``h``'s KV is this model's (layers, KV heads, head size) for its prompt's length."""
    m, n = model_info, len(h.prompt_token_ids)
    if len(h.kv_shape) != 5 or h.kv_shape[2] != n or \
            (h.kv_shape[0], h.kv_shape[3], h.kv_shape[4]) != (m.num_layers, m.num_kv_heads, m.head_dim):
        raise ValueError(f"the handed-over KV ({h.kv_shape}) is not this model's for a {n}-token prompt "
                         f"({m.num_layers} layers, {m.num_kv_heads} KV heads of {m.head_dim})")


def decode_request(h: KVHandoff, eos_token_ids: tuple[int, ...], max_model_len: int, now: float) -> Request:
    """The decode side's request: the prompt's KV counted as computed (the scheduler's hand-over path admits it
    as a decode), the first token already in its output."""
    request = Request(h.request_id, list(h.prompt_token_ids), h.sampling_params, eos_token_ids, max_model_len, now)
    request.output_token_ids.append(h.first_token_id)
    request.num_computed_tokens = len(h.prompt_token_ids)
    return request
