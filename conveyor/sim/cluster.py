"""Several engine instances on one virtual clock: colocated replicas, or prefill and decode instances with the KV
cache moved between them (disaggregated serving, as DistServe / Splitwise / Mooncake run it). PURE PYTHON.

Every ``Instance`` holds its own real ``core.Scheduler`` and KV manager and its own ``SimExecutor`` (its TP's
cost model), and is stepped exactly as ``loop.simulate`` steps a single engine: requests delivered to it by the
start of a step join its queue, a step ends after the cost model's seconds, an empty schedule polls again after
``idle_poll_s``, an instance with nothing to do sleeps until a delivery. What the cluster adds:

- routing, least-loaded: a new request goes to the front instance (colocated or prefill) with the fewest
  prompt tokens still to compute (prefill) or the fewest requests (colocated); a finished prefill goes to the
  decode instance holding the fewest requests (running, waiting and on their way). Ties: the lowest index.
- the hand-off: on a prefill instance a request runs with ``max_tokens=1``; when its first token is sampled it
  finishes there, but its blocks are held (``HeldKVManager``) until its KV has crossed the link. The transfer
  starts once the decode instance has room for the request's blocks (free blocks minus what queued and in-flight
  hand-offs will take), so a full decode side pushes back on prefill instead of over-filling; transfers on one
  prefill-decode link run one at a time (``KVLink``). When it lands, the prefill side frees the blocks and the
  decode side gets a request whose prompt KV is computed (``num_computed_tokens`` = prompt, the first token in
  its output): the real scheduler admits it, when blocks and a slot are free, as a one-token decode.

Events at one instant are taken in the single-engine loop's order: steps that end, then deliveries, then steps
that start, so each instance sees what ``loop.simulate`` would show it (``tests/sim/test_sim_disagg.py`` replays
every instance's deliveries through ``loop.simulate`` and gets the same schedule).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from conveyor.core.config import IDLE_POLL_S
from conveyor.core.request import Request
from conveyor.core.sampling_params import SamplingParams
from conveyor.sim.instance import COLOCATED, DECODE, PREFILL, Instance
from conveyor.sim.kv_transfer import KVLink, LinkSpec
from conveyor.sim.loop import MAX_IDLE_POLLS

_STEP_END, _DELIVERY, _STEP = 0, 1, 2  # event order within one instant (see the module doc)


@dataclass
class _Record:
    """One user request through the cluster."""

    request: Request  # the caller's (its arrival and sampling params); colocated: the one the scheduler runs
    prefill: Instance | None = None
    decode: Instance | None = None
    prefill_request: Request | None = None
    decode_request: Request | None = None
    token_times: list[float] = field(default_factory=list)
    first_token: float | None = None
    finished: float | None = None
    handoff_at: float | None = None  # prefill done
    transfer: tuple[float, float, float] | None = None  # (start, end, bytes)


@dataclass
class ClusterRequest:
    """A finished request as the user saw it, and where it went."""

    request_id: str
    num_prompt_tokens: int
    arrival: float
    first_scheduled: float | None
    first_token: float
    token_times: list[float]
    finished: float
    num_preemptions: int
    prefill_instance: str
    decode_instance: str | None
    handoff_at: float | None
    transfer: tuple[float, float, float] | None


@dataclass
class ClusterResult:
    requests: list[ClusterRequest]  # in the order they finished
    duration_s: float
    instances: list[Instance]
    links: dict[tuple[str, str], KVLink]


class Cluster:
    """The instances, the links between prefill and decode instances, and the event heap."""

    def __init__(self, instances: list[Instance], link: LinkSpec, kv_bytes_per_token: float,
                 idle_poll_s: float = IDLE_POLL_S, max_idle_polls: int = MAX_IDLE_POLLS) -> None:
        self.front = [i for i in instances if i.role != DECODE]
        self.decoders = [i for i in instances if i.role == DECODE]
        if not self.front or (any(i.role == PREFILL for i in self.front) != bool(self.decoders)):
            raise ValueError("a cluster is colocated instances only, or prefill and decode instances (both)")
        if any(i.role == COLOCATED for i in self.front) and self.decoders:
            raise ValueError("mixing colocated and disaggregated instances is not modelled")
        self.instances = instances
        self.kv_bytes_per_token = kv_bytes_per_token
        self.idle_poll_s, self.max_idle_polls = idle_poll_s, max_idle_polls
        self.links = {(p.name, d.name): KVLink(link, min(p.tp, d.tp)) for p in self.front for d in self.decoders}
        self.records: dict[str, _Record] = {}
        self.done: list[_Record] = []
        self._events: list = []
        self._seq = itertools.count()
        self.clock = 0.0

    def _push(self, t: float, order: int, kind: str, payload) -> None:
        heapq.heappush(self._events, (t, order, next(self._seq), kind, payload))

    def _wake(self, inst: Instance, now: float) -> None:
        if inst.sleeping:
            inst.sleeping = False
            self._push(now, _STEP, "step", inst)

    # ---- routing -----------------------------------------------------------------------------------------
    def _route_new(self, request: Request, now: float) -> None:
        rec = _Record(request)
        self.records[request.request_id] = rec
        if self.decoders:
            inst = min(self.front, key=Instance.pending_prefill_tokens)
            # Prefill side: the same request, stopping at its first token (which the decode side continues from).
            rec.prefill_request = Request(request.request_id, list(request.prompt_token_ids),
                                          SamplingParams(max_tokens=1, ignore_eos=True), request.eos_token_ids,
                                          request.max_model_len, now)
        else:
            inst = min(self.front, key=Instance.num_requests)
            rec.prefill_request = request
        rec.prefill = inst
        inst.deliver(rec.prefill_request, now)
        self._wake(inst, now)

    def _hand_off(self, rec: _Record, now: float) -> None:
        rec.handoff_at = now
        d = min(self.decoders, key=Instance.num_requests)
        rec.decode = d
        d.handoffs.append(rec)
        self._pump(d, now)

    def _pump(self, d: Instance, now: float) -> None:
        """Start the transfers to ``d`` that its free blocks can take, first come first served."""
        while d.handoffs:
            rec = d.handoffs[0]
            need = d.blocks_for(rec.request.num_prompt_tokens + 1)
            if need > d.room():
                return
            d.handoffs.pop(0)
            d.num_inbound += 1
            d.inbound_blocks += need
            num_bytes = self.kv_bytes_per_token * rec.request.num_prompt_tokens
            start, end = self.links[(rec.prefill.name, d.name)].transfer(num_bytes, now)
            rec.transfer = (start, end, num_bytes)
            self._push(end, _DELIVERY, "landed", (rec, need))

    def _landed(self, rec: _Record, need: int, now: float) -> None:
        d = rec.decode
        d.num_inbound -= 1
        d.inbound_blocks -= need
        rec.prefill.held.release(rec.request.request_id)
        src = rec.prefill_request
        # The decode side's request: the prompt's KV is in its cache once admitted (num_computed_tokens preset, the
        # scheduler's hand-over path), the first token is already output; it generates the rest.
        req = Request(src.request_id, list(src.prompt_token_ids), rec.request.sampling_params, src.eos_token_ids,
                      src.max_model_len, now)
        req.output_token_ids = list(src.output_token_ids)
        req.num_computed_tokens = src.num_prompt_tokens
        rec.decode_request = req
        d.deliver(req, now)
        self._wake(d, now)

    # ---- stepping ----------------------------------------------------------------------------------------
    def _step(self, inst: Instance, now: float) -> None:
        s = inst.scheduler
        for request in inst.inbox:
            s.add_request(request)
        inst.inbox.clear()
        if not s.has_unfinished_requests():
            inst.sleeping = True
            return
        so = s.schedule(now)
        if so.is_empty:
            inst.idle_polls += 1
            if inst.idle_polls > self.max_idle_polls:
                raise RuntimeError(f"{inst.name} schedules nothing while {s.num_waiting} requests wait and "
                                   f"{s.num_running} hold slots: a livelock")
            self._push(now + self.idle_poll_s, _STEP, "step", inst)
            return
        inst.idle_polls = 0
        if inst.observer is not None:
            inst.observer.before_step(now, so, s)
        model_out, cost = inst.executor.step(so)
        inst.in_step = (so, model_out, cost)
        self._push(now + cost.seconds, _STEP_END, "step_end", inst)

    def _step_end(self, inst: Instance, now: float) -> None:
        so, model_out, cost = inst.in_step
        inst.in_step = None
        s = inst.scheduler
        if inst.role == PREFILL:
            # Every request that samples here finishes (max_tokens=1): keep the blocks its KV is sent from.
            for rid in model_out.sampled_token_ids:
                if self.records[rid].request.sampling_params.max_tokens != 1:
                    inst.held.hold(rid)
        for update in s.update(so, model_out, now):
            rec = self.records[update.request_id]
            rec.token_times.append(now)
            if rec.first_token is None:
                rec.first_token = now
            if not update.finished:
                continue
            if inst.role == PREFILL and rec.request.sampling_params.max_tokens != 1:
                self._hand_off(rec, now)
            else:
                rec.finished = now
                self.done.append(rec)
        if inst.observer is not None:
            inst.observer.after_step(now, s, cost)
        inst.busy_s += cost.seconds
        inst.num_steps += 1
        if inst.role == DECODE:
            self._pump(inst, now)  # finished requests freed blocks: hand-offs may fit now
        self._push(now, _STEP, "step", inst)

    def run(self, requests: list[Request]) -> ClusterResult:
        """Run ``requests`` (``arrival_time`` in seconds from 0) until every one has finished."""
        for r in sorted(requests, key=lambda r: r.arrival_time):
            self._push(r.arrival_time, _DELIVERY, "arrive", r)
        handlers = {"arrive": lambda p, t: self._route_new(p, t), "landed": lambda p, t: self._landed(*p, t),
                    "step": lambda p, t: self._step(p, t), "step_end": lambda p, t: self._step_end(p, t)}
        while self._events:
            t, _, _, kind, payload = heapq.heappop(self._events)
            self.clock = max(self.clock, t)
            handlers[kind](payload, t)
        missing = len(requests) - len(self.done)
        if missing:
            raise RuntimeError(f"{missing} requests never finished (a hand-off that never found room?)")
        return ClusterResult([self._result(r) for r in self.done], self.clock, self.instances, self.links)

    @staticmethod
    def _result(rec: _Record) -> ClusterRequest:
        p, d = rec.prefill_request, rec.decode_request
        preemptions = p.num_preemptions + (d.num_preemptions if d is not None else 0)
        return ClusterRequest(rec.request.request_id, rec.request.num_prompt_tokens, rec.request.arrival_time,
                              p.times.first_scheduled, rec.first_token, rec.token_times, rec.finished, preemptions,
                              rec.prefill.name, rec.decode.name if rec.decode else None, rec.handoff_at,
                              rec.transfer)


def simulate_cluster(instances: list[Instance], requests: list[Request], link: LinkSpec,
                     kv_bytes_per_token: float, idle_poll_s: float = IDLE_POLL_S,
                     max_idle_polls: int = MAX_IDLE_POLLS) -> ClusterResult:
    """Run ``requests`` through ``instances`` (see the module doc); the link prices prefill-to-decode transfers."""
    return Cluster(instances, link, kv_bytes_per_token, idle_poll_s, max_idle_polls).run(requests)
