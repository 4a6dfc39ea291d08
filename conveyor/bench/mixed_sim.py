"""``bench mixed --simulate``: the same traffic on the simulator, the real scheduler (priority policy included)
stepped on a cost model, and SLO-aware admission with the server's prediction (``sim.admission``). The batch is
sent as the HTTP run sends it: ``--batch-concurrency`` requests in flight, the next when one ends (the Batch API's
runner does the same), from the start; the interactive stream starts ``BATCH_START_S`` later."""

from __future__ import annotations

import argparse

from conveyor.bench.metrics import RequestTiming, percentile
from conveyor.bench.mixed import MixedResult, MixedTraffic, result_of
from conveyor.bench.mixed_http import BATCH_START_S
from conveyor.bench.simulate import build_scheduler, load_target, num_kv_blocks, resolve_spec
from conveyor.bench.workload import WorkloadRequest
from conveyor.core.admission import EngineShape, ServiceClass
from conveyor.core.policies import BATCH_PRIORITY
from conveyor.core.request import Request
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.sim import RooflineCostModel, SimExecutor, simulate
from conveyor.sim.admission import CostModelStepTime, SimAdmission


def add_sim_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("with --simulate: the simulated engine")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=8192)
    g.add_argument("--kv-cache-memory", type=float, default=40.0, help="GiB over all devices")
    g.add_argument("--priority-step-slack", type=float, default=None,
                   help="as conveyor serve's: the batch adds at most this fraction to an interactive step's time")
    g.add_argument("--service-class", default=None, metavar="NAME:ttft=MS,tpot=MS",
                   help="SLO-aware admission of the interactive requests against this class's targets (as "
                   "conveyor serve --service-class)")


def run_simulated(ns: argparse.Namespace, traffic: MixedTraffic, mode: str) -> MixedResult:
    target = load_target(ns.simulate)
    spec = resolve_spec(ns.model, target)
    cost = RooflineCostModel(spec, target.hardware, ns.tensor_parallel_size)
    args = EngineArgs(max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
                      kv_cache_memory=ns.kv_cache_memory, max_model_len=ns.max_model_len,
                      scheduling_policy="fcfs" if mode == "fcfs" else "priority",
                      priority_step_slack=None if mode == "fcfs" else ns.priority_step_slack)
    max_model_len = min(ns.max_model_len, spec.max_position_embeddings)
    scheduler = build_scheduler(args, num_kv_blocks(args, cost, max_model_len), max_model_len)
    service = ServiceClass.parse(ns.service_class) if ns.service_class else ServiceClass("interactive")
    start = BATCH_START_S if mode in ("batch-api", "fcfs", "low-priority") else 0.0

    def request(rid: str, r: WorkloadRequest, priority: int, arrival: float) -> Request:
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, priority=priority)
        return Request(rid, r.prompt_token_ids, params, (), max_model_len, arrival)

    interactive = [] if mode == "offline" else [request(f"i{r.id}", r, service.priority, start + r.arrival_s)
                                                   for r in traffic.interactive.requests]
    batch_priority = {"batch-api": BATCH_PRIORITY, "low-priority": ns.low_priority}.get(mode, 0)
    queue = [] if mode == "alone" else list(traffic.batch.requests)
    in_flight = len(queue) if mode == "offline" else ns.batch_concurrency  # offline: all at once
    first = [request(f"b{r.id}", r, batch_priority, 0.0) for r in queue[:in_flight]]
    del queue[:in_flight]

    def follow(finished: Request, now: float) -> list[Request]:
        if not finished.request_id.startswith("b") or not queue:
            return []
        r = queue.pop(0)
        return [request(f"b{r.id}", r, batch_priority, now)]

    admission = None
    if ns.service_class and mode != "offline":
        typical = sum(r.prompt_len + r.max_tokens // 2 for r in traffic.interactive.requests) // max(
            len(traffic.interactive.requests), 1)
        admission = SimAdmission(service, EngineShape(args.max_num_batched_tokens, args.max_num_seqs),
                                 CostModelStepTime(cost, typical))
    result = simulate(scheduler, SimExecutor(cost), interactive + first, admit=admission, follow=follow)
    timings = {s.request.request_id: s for s in result.requests}
    mine = [timings[r.request_id] for r in interactive if r.request_id in timings]
    if mode == "offline":
        window_start, window_end = 0.0, result.duration_s
    else:
        window_start = start
        window_end = max((s.request.times.finished for s in mine), default=start)
    tokens = sum(1 for s in result.requests for t in s.token_times if window_start < t <= window_end)
    batch_done = sum(1 for s in result.requests if s.request.request_id.startswith("b")
                     and s.request.times.finished <= window_end)
    rows = [RequestTiming(s.request.request_id, s.request.num_prompt_tokens, len(s.token_times),
                          s.request.arrival_time, s.request.times.first_token, s.token_times, s.request.times.finished)
            for s in mine]
    rows += [RequestTiming(r.request_id, r.num_prompt_tokens, 0, r.arrival_time, None, [], r.arrival_time,
                           error="refused") for r in result.refused]
    return result_of(mode, rows, window_end - window_start, tokens, traffic.slo_ms, [0.0] * len(result.refused),
                     batch_done, _prediction_error(admission, timings))


def _prediction_error(admission: SimAdmission | None, timings: dict) -> dict:
    """The TTFT and TPOT predictions at admission against what the simulation measured, keyed as over HTTP."""
    if admission is None:
        return {}
    ttft, tpot = [], []
    for rid, p in admission.predicted.items():
        if (t := timings.get(rid)) is None:
            continue
        ttft.append((p.ttft_s, t.request.times.first_token - t.request.arrival_time))
        if p.tpot_s is not None and len(t.token_times) > 1:
            tpot.append((p.tpot_s, (t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1)))
    out = {}
    for what, pairs in (("ttft", ttft), ("tpot", tpot)):
        if pairs:
            errors = [abs(m - p) for p, m in pairs]
            ratios = [m / p for p, m in pairs if p > 0]
            for q in (50, 90):
                out[f"{what}_abs_error_s_p{q}"] = percentile(errors, q)
                out[f"{what}_measured_over_predicted_p{q}"] = percentile(ratios, q)
    return out
