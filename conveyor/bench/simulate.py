"""``bench compare --simulate``: the same configurations on the simulator, written as the same results document.

Every configuration gets a fresh ``core.Scheduler`` and KV manager (the real ones) driven by ``sim.simulate``;
the requests are the workload's (prompt token ids, output lengths, arrival times); the timings and step records
go through the same ``metrics.summarize`` and ``engine_metrics.engine_stats`` as a real run, so tables, plots
and report.md work unchanged. Each run also gets a ``sim`` entry: FLOPs and bytes moved, MFU, MBU.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from conveyor.bench.engine_metrics import engine_stats, step_dict
from conveyor.bench.metrics import RequestTiming, summarize
from conveyor.bench.offline import workload_work
from conveyor.bench.prefix_savings import prefix_savings
from conveyor.bench.workload import Workload, time_scale_for
from conveyor.core.kv_manager import KVCacheManager
from conveyor.core.request import Request
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler
from conveyor.core.sliding_window import freeable_window
from conveyor.core.slab_manager import SlabKVManager
from conveyor.engine.step_record import StepRecord
from conveyor.sim import Hardware, ModelSpec, RooflineCostModel, SimExecutor, get_hardware, get_model_spec, simulate

PROFILE_FORMAT = "conveyor-sim-profile/1"


@dataclass
class SimTarget:
    """What to simulate on: a hardware entry (from the table, or a calibration profile) and its default model."""

    hardware: Hardware
    label: str
    model: ModelSpec | None = None  # a profile's model: its overheads were measured with it


def load_target(text: str) -> SimTarget:
    """A hardware name from ``sim.HARDWARE``, or the path of a profile written by ``conveyor sim calibrate``."""
    path = Path(text)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"simulation profile not found: {path}")
        profile = json.loads(path.read_text())
        if profile.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{path} is not a conveyor simulation profile (format {profile.get('format')!r})")
        return SimTarget(Hardware.from_dict(profile["hardware"]), f"profile {path}", ModelSpec(**profile["model"]))
    return SimTarget(get_hardware(text), text)


def resolve_spec(model: str | None, target: SimTarget) -> ModelSpec:
    """``--model``: a name from the simulator's table or a Hugging Face directory (its config.json); without it,
    the profile's model, else the bench model."""
    if model is None:
        return target.model or get_model_spec("bench-llama-40m")
    if (Path(model) / "config.json").is_file():
        return spec_from_model_dir(model)
    return get_model_spec(model)


def spec_from_model_dir(model_dir: str) -> ModelSpec:
    """The simulator's view of a Hugging Face directory: its config.json, read by its family as the real loader
    reads it (``models.registry``), described by ``ModelConfig.spec``."""
    from conveyor.models.registry import config_from_hf

    config = Path(model_dir) / "config.json"
    return config_from_hf(json.loads(config.read_text()), str(config)).spec(Path(model_dir).name)


def num_kv_blocks(args, cost: RooflineCostModel, max_model_len: int) -> int:
    """KV blocks from ``num_kv_blocks`` or ``kv_cache_memory`` (GiB over all devices), checked against memory."""
    per_block = cost.kv_bytes_per_token() * args.block_size
    blocks = args.num_kv_blocks or int(args.kv_cache_memory * (1 << 30)) // int(per_block)
    if blocks * args.block_size < max_model_len:
        raise ValueError(f"KV cache too small: {blocks} blocks x {args.block_size} tokens cannot hold one sequence "
                         f"of max_model_len={max_model_len}; raise --kv-cache-memory or lower --max-model-len")
    hw = cost.hw
    per_device = cost.weight_bytes() + blocks * per_block / cost.tp
    if per_device > hw.memory_bytes:
        raise ValueError(f"{cost.model.name} weights ({cost.weight_bytes() / 1e9:.1f} GB per device) plus the KV "
                         f"cache ({blocks * per_block / cost.tp / 1e9:.1f} GB per device) exceed {hw.name}'s "
                         f"{hw.memory_bytes / 1e9:.0f} GB: lower --kv-cache-memory or raise --tensor-parallel-size")
    return blocks


def build_scheduler(args, blocks: int, max_model_len: int, layer_windows: tuple[int, ...] = ()) -> Scheduler:
    """The real scheduler and KV manager, configured from ``EngineArgs`` as ``LLMEngine`` configures them (the
    model's ``layer_windows``: blocks outside every sliding window are given back, as the engine does)."""
    if args.kv_layout == "slab":
        kv = SlabKVManager(blocks, args.block_size, max_model_len)
    else:
        window = freeable_window(layer_windows) if args.free_outside_window else 0
        kv = KVCacheManager(blocks, args.block_size, args.enable_prefix_caching, args.prefix_cache_eviction,
                            sliding_window=window)
    return Scheduler(args.scheduler_config(max_model_len), kv)


def sim_requests(workload: Workload, time_scale: float, max_model_len: int) -> list[Request]:
    """The workload's requests as the scheduler's ``Request``s: each generates exactly ``max_tokens`` tokens."""
    out = []
    for r in workload.requests:
        if r.prompt_token_ids is None:
            raise ValueError(f"request {r.id}: the simulator needs prompt_token_ids (it has no tokenizer)")
        if not 0 < len(r.prompt_token_ids) < max_model_len:
            raise ValueError(f"request {r.id}: a prompt of {len(r.prompt_token_ids)} tokens leaves no room to "
                             f"generate within max_model_len={max_model_len}")
        # a trace's per-request KV budget (bench workload --kv-budget-fraction) is a scheduling input; the
        # other sampling fields change no schedule (the simulator's tokens are placeholders)
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True,
                                kv_budget_tokens=r.params.get("kv_budget_tokens"))
        out.append(Request(str(r.id), r.prompt_token_ids, params, (), max_model_len, r.arrival_s * time_scale))
    return out


class StepRecorder:
    """The engine's ``StepRecord`` for every simulated step, plus the cost model's FLOPs and bytes."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self.flops = self.bytes = 0.0

    def before_step(self, start, so, scheduler) -> None:
        self.steps.append(StepRecord.before(start, so, scheduler))

    def after_step(self, end, scheduler, cost) -> None:
        self.steps[-1].finish(end, scheduler)
        self.flops += cost.flops
        self.bytes += cost.bytes


def timings_of(result) -> list[RequestTiming]:
    """Per-request timings in the benchmark's form (a parked static slot's extra tokens are not output)."""
    out = []
    for sim_req in result.requests:
        r, t = sim_req.request, sim_req.request.times
        out.append(RequestTiming(r.request_id, r.num_prompt_tokens, len(sim_req.token_times), r.arrival_time,
                                 t.first_token, sim_req.token_times, t.finished, t.first_scheduled))
    return out


def run_all_simulated(ns, base_args, configs, workload: Workload, progress: bool = True,
                      cluster_runs=None) -> dict:
    """Simulate every configuration; return the results document (the schema of ``compare.run_all``).

    ``cluster_runs`` (``bench.simulate_cluster.cluster_runs``, passed in by ``--disaggregate``) runs every
    configuration on every multi-instance layout instead of on one engine."""
    target = load_target(ns.simulate)
    spec = resolve_spec(base_args.model, target)
    tp = ns.tensor_parallel_size
    hw = target.hardware
    peak_flops, peak_bw = hw.peak_flops * tp, hw.mem_bandwidth * tp
    flops = spec.forward_flops(*workload_work(workload.num_prompt_tokens, workload.num_output_tokens,
                                              len(workload.requests)))
    prompts = {str(r.id): r.prompt_token_ids for r in workload.requests if r.prompt_token_ids is not None}
    runs = []
    disaggregate = getattr(ns, "disaggregate", None)
    if disaggregate:
        runs = cluster_runs(ns, base_args, configs, workload, spec, hw, flops, progress)
        tp = max(run["cluster"]["gpus"] for run in runs)  # the table's peaks: the largest layout's GPUs
        peak_flops, peak_bw = hw.peak_flops * tp, hw.mem_bandwidth * tp
    for config in [] if disaggregate else configs:
        args = replace(base_args, **dict(config.overrides))
        cost = RooflineCostModel(spec, hw, tp, kv_cache_dtype=args.kv_cache_dtype)
        max_model_len = args.max_model_len or spec.max_position_embeddings
        blocks = num_kv_blocks(args, cost, max_model_len)
        scale = time_scale_for(workload, config.request_rate, ns.time_scale)
        recorder = StepRecorder()
        t0 = time.perf_counter()
        scheduler = build_scheduler(args, blocks, max_model_len, spec.layer_windows)
        result = simulate(scheduler, SimExecutor(cost), sim_requests(workload, scale, max_model_len), recorder)
        if progress:
            print(f"{config.label}: {len(result.requests)} requests, {result.num_steps} steps, "
                  f"{result.duration_s:.1f} virtual s in {time.perf_counter() - t0:.1f} s")
        duration = result.duration_s
        stats = engine_stats(recorder.steps, duration, flops, peak_flops / 1e9, cost.weight_bytes() * tp,
                             peak_bw / 1e9, max_num_seqs=args.max_num_seqs)
        last_arrival = max(r.arrival_s for r in workload.requests)
        runs.append({
            "label": config.label, "overrides": dict(config.overrides), "request_rate": config.request_rate,
            "offered_rate": len(workload.requests) / (last_arrival * scale) if scale and last_arrival > 0 else None,
            "num_kv_blocks": blocks, "summary": summarize(timings_of(result), duration, ns.slo_ms).to_dict(),
            "engine": stats.to_dict(), "timings": [asdict(t) for t in timings_of(result)],
            "prefix": prefix_savings(recorder.steps, 2.0 * spec.per_token_linear_params, 4.0 * spec.num_layers
                                     * spec.q_dim, prompts, args.block_size, kv=scheduler.kv).to_dict(),
            "steps": [step_dict(s) for s in recorder.steps], "output_token_ids": {},
            "sim": {"flops": recorder.flops, "bytes": recorder.bytes, "busy_s": result.busy_s,
                    "mfu": flops / duration / peak_flops if duration > 0 else 0.0,
                    "hfu": recorder.flops / duration / peak_flops if duration > 0 else 0.0,
                    "mbu": recorder.bytes / duration / peak_bw if duration > 0 else 0.0},
        })
    machine = {"matmul_gflops": peak_flops / 1e9, "skinny_gflops": peak_flops / 1e9,
               "mem_bandwidth_gbs": peak_bw / 1e9, "square_n": 0}
    return {"workload": workload.name, "num_requests": len(workload.requests),
            "prompt_tokens": workload.num_prompt_tokens, "output_tokens": workload.num_output_tokens,
            "offline": ns.offline, "machine": machine, "model": spec.name, "model_flops": flops,
            "base_args": asdict(base_args), "runs": runs,
            "simulated": {"target": target.label, "hardware": hw.to_dict(), "tensor_parallel_size": tp,
                          # per instance: a cluster's tp above is its GPU count, which a CPU profile (no
                          # device-to-device link) cannot price as one tensor-parallel model
                          "model": asdict(spec),
                          "cost_model": RooflineCostModel(spec, hw, ns.tensor_parallel_size).describe(),
                          "disaggregate": disaggregate}}

