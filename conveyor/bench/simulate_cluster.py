"""``bench compare --simulate ... --disaggregate 2C@4,1P1D@4``: multi-instance layouts on the simulator.

Each layout (``sim.layout``) becomes instances with their own real ``core.Scheduler`` and KV manager, built from
the same ``EngineArgs`` as a single simulated engine, and runs through ``sim.cluster``. The result is one run
of the results document, in the schema of ``bench.simulate`` (summary, engine stats, timings, steps), plus a
``cluster`` entry: the layout, the link, per instance its steps, busy time and peak KV usage, and the transfers.

KV memory: each instance gets what its GPUs have left at ``--gpu-memory-utilization`` (vLLM's name and default,
0.9) after its share of the weights, unless ``--num-kv-blocks`` fixes a count per instance; the single-engine
``--kv-cache-memory`` would not scale with the TP of each instance, so it is not used here.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace

from conveyor.bench.engine_metrics import engine_stats, step_dict
from conveyor.bench.metrics import RequestTiming, percentile, summarize
from conveyor.bench.simulate import StepRecorder, build_scheduler, sim_requests
from conveyor.bench.workload import Workload, time_scale_for
from conveyor.sim import Hardware, ModelSpec, RooflineCostModel, SimExecutor
from conveyor.sim.cluster import PREFILL, ClusterResult, Instance, simulate_cluster
from conveyor.sim.held_kv import HeldKVManager
from conveyor.sim.kv_transfer import LinkSpec, get_link
from conveyor.sim.layout import Layout, parse_layout


def instance_kv_blocks(args, cost: RooflineCostModel, max_model_len: int, utilization: float) -> int:
    """KV blocks of one instance: ``num_kv_blocks`` if given, else its GPUs' memory left after the weights."""
    per_block = cost.kv_bytes_per_token() * args.block_size
    if args.num_kv_blocks:
        blocks = args.num_kv_blocks
    else:
        free_per_device = utilization * cost.hw.memory_bytes - cost.weight_bytes()
        blocks = int(max(free_per_device, 0.0) * cost.tp // per_block)
    if blocks * args.block_size < max_model_len:
        raise ValueError(f"{cost.model.name} on TP{cost.tp} x {cost.hw.name}: {blocks} KV blocks of "
                         f"{args.block_size} tokens cannot hold one sequence of max_model_len={max_model_len} "
                         "(weights leave too little memory): use a larger TP for this instance")
    return blocks


def build_instances(layout: Layout, args, spec: ModelSpec, hw: Hardware, max_model_len: int,
                    utilization: float, prefill_budget: int | None = None) -> list[Instance]:
    """The layout's instances, each with its scheduler (from ``args``; prefill instances with the token budget
    ``prefill_budget`` when given), KV blocks, cost model and step recorder."""
    instances = []
    counters: dict[str, int] = {}
    for role, tp in layout.roles():
        cost = RooflineCostModel(spec, hw, tp, kv_cache_dtype=args.kv_cache_dtype)
        role_args = replace(args, max_num_batched_tokens=prefill_budget) if role == PREFILL and prefill_budget \
            else args
        blocks = instance_kv_blocks(role_args, cost, max_model_len, utilization)
        scheduler = build_scheduler(role_args, blocks, max_model_len, spec.layer_windows)
        if role == PREFILL:
            scheduler.kv = HeldKVManager(scheduler.kv)
        n = counters[role] = counters.get(role, -1) + 1
        instances.append(Instance(f"{role[0].upper()}{n}", role, scheduler, SimExecutor(cost), tp, StepRecorder()))
    return instances


def cluster_timings(result: ClusterResult) -> list[RequestTiming]:
    """Per-request timings as the user sees them: the first token from the prefill side, the rest from decode."""
    return [RequestTiming(r.request_id, r.num_prompt_tokens, len(r.token_times), r.arrival, r.first_token,
                          r.token_times, r.finished, r.first_scheduled) for r in result.requests]


def cluster_summary(result: ClusterResult, link: LinkSpec) -> dict:
    """Where the requests went and what the link did: the ``cluster`` entry of a run."""
    transfers = [r.transfer for r in result.requests if r.transfer]
    waits = [r.transfer[0] - r.handoff_at for r in result.requests if r.transfer]
    secs = [end - start for start, end, _ in transfers]
    instances = []
    for inst in result.instances:
        steps = inst.observer.steps
        instances.append({
            "name": inst.name, "role": inst.role, "tp": inst.tp, "num_kv_blocks": inst.scheduler.kv.num_blocks,
            "num_steps": inst.num_steps, "busy_s": inst.busy_s,
            "busy_fraction": inst.busy_s / result.duration_s if result.duration_s > 0 else 0.0,
            "num_requests": sum(1 for d in inst.deliveries), "preemptions": inst.scheduler.num_preemptions,
            "peak_kv_usage": max((s.kv_usage for s in steps), default=0.0),
            "final_kv_usage": inst.scheduler.kv.usage(),
        })
    return {
        "link": asdict(link), "link_description": link.describe(), "instances": instances,
        "num_transfers": len(transfers), "transfer_bytes": sum(b for _, _, b in transfers),
        "transfer_s": {"mean": sum(secs) / len(secs) if secs else 0.0, "p99": percentile(secs, 99)},
        "handoff_wait_s": {"mean": sum(waits) / len(waits) if waits else 0.0, "p99": percentile(waits, 99)},
    }


def run_layout(ns, base_args, config, layout: Layout, spec: ModelSpec, hw: Hardware, link: LinkSpec,
               workload: Workload, flops: float, progress: bool = True) -> dict:
    """One configuration on one layout: a run of the results document."""
    args = replace(base_args, **dict(config.overrides))
    if args.kv_layout != "paged":
        raise ValueError("--disaggregate simulates the paged KV layout only")
    max_model_len = args.max_model_len or spec.max_position_embeddings
    instances = build_instances(layout, args, spec, hw, max_model_len, ns.gpu_memory_utilization,
                                getattr(ns, "prefill_max_num_batched_tokens", None))
    scale = time_scale_for(workload, config.request_rate, ns.time_scale)
    t0 = time.perf_counter()
    result = simulate_cluster(instances, sim_requests(workload, scale, max_model_len), link,
                              RooflineCostModel(spec, hw, kv_cache_dtype=args.kv_cache_dtype).kv_bytes_per_token())
    label = f"{layout.label} {config.label}" if config.label != "default" else layout.label
    if progress:
        print(f"{label}: {len(result.requests)} requests, {sum(i.num_steps for i in instances)} steps on "
              f"{len(instances)} instances, {result.duration_s:.1f} virtual s in {time.perf_counter() - t0:.1f} s")
    duration = result.duration_s
    # Engine stats over every instance's steps together (means are over all steps; peaks over all instances).
    # The weight-bandwidth fraction is left out: each instance streams its own copy of the weights per step.
    steps = sorted((s for inst in instances for s in inst.observer.steps), key=lambda s: s.start)
    gpus = layout.gpus
    peak_flops, peak_bw = hw.peak_flops * gpus, hw.mem_bandwidth * gpus
    sim_flops = sum(inst.observer.flops for inst in instances)
    sim_bytes = sum(inst.observer.bytes for inst in instances)
    stats = engine_stats(steps, duration, flops, peak_flops / 1e9, max_num_seqs=args.max_num_seqs * len(instances))
    timings = cluster_timings(result)
    last_arrival = max(r.arrival_s for r in workload.requests)
    return {
        "label": label, "overrides": {**dict(config.overrides), "layout": layout.label},
        "request_rate": config.request_rate,
        "offered_rate": len(workload.requests) / (last_arrival * scale) if scale and last_arrival > 0 else None,
        "num_kv_blocks": sum(inst.scheduler.kv.num_blocks for inst in instances),
        "summary": summarize(timings, duration, ns.slo_ms).to_dict(), "engine": stats.to_dict(),
        "timings": [asdict(t) for t in timings],
        "steps": [{**step_dict(s), "instance": inst.name} for inst in instances for s in inst.observer.steps],
        "output_token_ids": {},
        "sim": {"flops": sim_flops, "bytes": sim_bytes, "busy_s": sum(i.busy_s for i in instances),
                "mfu": flops / duration / peak_flops if duration > 0 else 0.0,
                "hfu": sim_flops / duration / peak_flops if duration > 0 else 0.0,
                "mbu": sim_bytes / duration / peak_bw if duration > 0 else 0.0},
        "cluster": {"layout": layout.label, "description": layout.describe(), "gpus": gpus,
                    **cluster_summary(result, link)},
    }


def cluster_runs(ns, base_args, configs, workload: Workload, spec: ModelSpec, hw: Hardware, flops: float,
                 progress: bool) -> list[dict]:
    """``--disaggregate``: every configuration on every layout, as runs of the results document."""
    layouts = [parse_layout(text, ns.tensor_parallel_size) for text in ns.disaggregate.split(",")]
    link = get_link(ns.kv_link)
    if ns.kv_link_gbps:
        link = replace(link, name=f"{link.name}@{ns.kv_link_gbps:g}Gbps", bandwidth=ns.kv_link_gbps * 1e9 / 8)
    if progress:
        print(f"layouts: {'; '.join(l.describe() for l in layouts)}; KV link {link.describe()}")
    return [run_layout(ns, base_args, config, layout, spec, hw, link, workload, flops, progress)
            for layout in layouts for config in configs]
