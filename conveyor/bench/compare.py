"""``conveyor bench compare``: several engine configurations on one workload, in one process, one after another.

The model and tokenizer are loaded once; every configuration gets a fresh scheduler, KV cache and runner
(``LLMEngine.sharing_model``), so the runs differ only in what is being compared. Comma-separated values of a
knob sweep it; the configurations are the product of the sweeps, minus knobs a policy ignores (``max_wait_ms``
only shapes dynamic batching, ``max_num_batched_tokens`` only chunked prefill). Writes results.json, PNG plots
and report.md into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from conveyor.bench.engine_metrics import engine_stats, step_dict
from conveyor.bench.metrics import summarize
from conveyor.bench.prefix_savings import prefix_savings
from conveyor.bench.workload import Workload, load_workload, time_scale_for

def parse_bool(text: str) -> bool:
    """A swept on/off flag's value: true / false (also on / off, yes / no, 1 / 0)."""
    value = text.strip().lower()
    if value not in ("true", "false", "on", "off", "yes", "no", "1", "0"):
        raise ValueError(f"expected true or false, got {text!r}")
    return value in ("true", "on", "yes", "1")


# knob -> (EngineArgs field, parser, label prefix, policies it matters to (None: all))
SWEEPS = {
    "policies": ("policy", str, "", None),
    "max_num_seqs": ("max_num_seqs", int, "B=", None),
    "max_wait_ms": ("max_wait_ms", float, "wait=", ("dynamic",)),
    "block_size": ("block_size", int, "bs=", None),
    "max_num_batched_tokens": ("max_num_batched_tokens", int, "T=", ("chunked",)),
    "kv_layout": ("kv_layout", str, "", None),
    "prefix_cache_eviction": ("prefix_cache_eviction", str, "evict=", None),
    "kv_cache_memory": ("kv_cache_memory", float, "kv=", None),
    "free_outside_window": ("free_outside_window", parse_bool, "free-window=", None),
    "request_rate": ("request_rate", float, "rate=", None),
}
# The sweeps that are engine flags of the same name (--policies and --request-rate are flags of their own).
ENGINE_SWEEPS = tuple(n for n in SWEEPS if n not in ("policies", "request_rate"))


@dataclass(frozen=True)
class RunConfig:
    """One configuration to run: EngineArgs overrides, an arrival rate (None: the trace's), and a label."""

    overrides: tuple[tuple[str, object], ...]
    request_rate: float | None
    label: str = ""

    def get(self, name: str, default=None):
        return dict(self.overrides).get(name, default)


def parse_list(text: str | None, kind) -> list:
    return [] if text in (None, "") else [kind(v) for v in str(text).split(",")]


def expand_configs(sweeps: dict[str, list]) -> list[RunConfig]:
    """The product of the swept values, deduplicated where a knob does not apply to a policy, labelled by what
    varies (``static B=8``, ``chunked T=512 slab``)."""
    names = [n for n in SWEEPS if sweeps.get(n)]
    configs: list[RunConfig] = []
    for values in itertools.product(*(sweeps[n] for n in names)):
        chosen = dict(zip(names, values))
        policy = chosen.get("policies", "chunked")
        kept = {n: v for n, v in chosen.items() if SWEEPS[n][3] is None or policy in SWEEPS[n][3]}
        rate = kept.pop("request_rate", None)
        overrides = tuple((SWEEPS[n][0], v) for n, v in kept.items())
        config = RunConfig(overrides, rate)
        if config not in configs:
            configs.append(config)
    varying = [n for n in names if len({c.get(SWEEPS[n][0]) if n != "request_rate" else c.request_rate
                                         for c in configs} - {None}) > 1 or n == "policies"]
    labelled = []
    for c in configs:
        parts = []
        for n in varying:
            field, _, prefix, _ = SWEEPS[n]
            value = c.request_rate if n == "request_rate" else c.get(field)
            if value is not None:
                parts.append(f"{prefix}{value:g}" if isinstance(value, float) else f"{prefix}{value}")
        labelled.append(replace(c, label=" ".join(parts) or "default"))
    return labelled


def workload_prompts(workload: Workload) -> dict[str, list[int]]:
    """Request id -> prompt token ids, for the requests that carry them (the by-prefix hit table)."""
    return {str(r.id): r.prompt_token_ids for r in workload.requests if r.prompt_token_ids is not None}


def prepare_workload(workload: Workload, num_requests: int | None, offline: bool) -> Workload:
    if num_requests:
        workload = Workload(workload.name, workload.requests[:num_requests], workload.seed,
                            workload.arrival_rate_req_s, workload.notes)
    return workload.all_at_once() if offline else workload


def run_all(ns, base_args, configs: list[RunConfig], workload: Workload, progress: bool = True) -> dict:
    """Run every configuration; return the results document (what results.json holds)."""
    import torch

    # The random-weights model drifts into denormal floats on some sequences; x86 handles those ~100x slower
    # (microcode assists), which made whichever configuration met them look 5-10x slower. Flushing them to zero
    # is what CPU inference stacks do; it applies to every configuration alike and is undone on return.
    torch.set_flush_denormal(bool(ns.flush_denormal))
    try:
        return _run_configs(ns, base_args, configs, workload, progress)
    finally:
        torch.set_flush_denormal(False)


def _run_configs(ns, base_args, configs: list[RunConfig], workload: Workload, progress: bool) -> dict:
    from tqdm.auto import tqdm

    from conveyor.bench.machine import measure_roofline
    from conveyor.bench.offline import model_flops
    from conveyor.bench.online import replay
    from conveyor.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    base = LLMEngine(base_args)
    print(f"model {base.model_info.name} loaded in {time.perf_counter() - t0:.1f} s")
    if not ns.no_warmup:  # first-call costs (allocator, kernels) must not land on the first configuration
        replay(base, Workload("warmup", workload.all_at_once().requests[:8]))
    roof = measure_roofline(base.device, quick=True)
    print(f"machine: {roof.describe()}")
    weight_bytes = sum(p.numel() * p.element_size() for p in base.model.parameters())
    flops = model_flops(base.model_info, workload.num_prompt_tokens, workload.num_output_tokens,
                        len(workload.requests))
    from conveyor.models.flops import prefix_hit_flops

    hit_flops = prefix_hit_flops(base.model_info)  # a prefix hit's FLOPs: per token through the layers, per key
    prompts = workload_prompts(workload)
    runs = []
    for config in configs:
        args = replace(base_args, **dict(config.overrides))
        engine = LLMEngine.sharing_model(base, args)
        scale = time_scale_for(workload, config.request_rate, ns.time_scale)
        with tqdm(total=len(workload.requests), desc=config.label, unit="req", disable=not progress) as bar:
            result = replay(engine, workload, time_scale=scale, progress=bar.update)
        summary = summarize(result.timings, result.duration_s, ns.slo_ms)
        stats = engine_stats(result.steps, result.duration_s, flops, roof.matmul_gflops, weight_bytes,
                             roof.mem_bandwidth_gbs, max_num_seqs=args.max_num_seqs)
        runs.append({
            "label": config.label, "overrides": dict(config.overrides), "request_rate": config.request_rate,
            "offered_rate": (len(workload.requests) / (max(r.arrival_s for r in workload.requests) * scale)
                             if scale and workload.requests[-1].arrival_s > 0 else None),
            "num_kv_blocks": engine.num_kv_blocks, "summary": summary.to_dict(), "engine": stats.to_dict(),
            "prefix": prefix_savings(result.steps, *hit_flops, prompts, args.block_size,
                                     kv=engine.kv_manager).to_dict(),
            "timings": [asdict(t) for t in result.timings], "steps": [step_dict(s) for s in result.steps],
            "output_token_ids": result.output_token_ids,
        })
        del engine
        gc.collect()
    return {"workload": workload.name, "num_requests": len(workload.requests),
            "prompt_tokens": workload.num_prompt_tokens, "output_tokens": workload.num_output_tokens,
            "offline": ns.offline, "machine": asdict(roof), "model": base.model_info.name, "model_flops": flops,
            "base_args": asdict(base_args), "runs": runs}


def add_compare_parser(sub) -> None:
    from conveyor.engine.args import EngineArgs

    # "resolve": the swept engine flags are re-added below as comma-separated lists.
    p = sub.add_parser("compare", conflict_handler="resolve",
                       help="compare policies / knob sweeps on one workload: table, plots, report")
    EngineArgs.add_cli_args(p)
    p.add_argument("--workload", default="longtail_v1", help="a packaged trace's name (longtail_v1) or a "
                   "trace file")
    p.add_argument("--out", default="compare-out", help="directory for results.json, plots and report.md")
    p.add_argument("--policies", "--policy", dest="policies", default="static,dynamic,continuous,chunked")
    defaults = EngineArgs()
    for name in ENGINE_SWEEPS:
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, default=str(getattr(defaults, name)),
                       help="one value, or a comma-separated list to sweep")
    p.add_argument("--request-rate", default=None, help="req/s to rescale arrivals to; comma list: load sweep")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (when no --request-rate)")
    p.add_argument("--offline", action="store_true", help="every request at t=0 (throughput runs)")
    p.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    p.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft=500,tpot=100")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--simulate", default=None, metavar="PROFILE_OR_HARDWARE",
                   help="run on the simulator instead: a hardware name of conveyor.sim.HARDWARE (a100-80gb, "
                        "h100-sxm, h200, ...) or a profile JSON from `conveyor sim calibrate`; --model then names a "
                        "model of the simulator's table or a Hugging Face directory (default: the profile's model, "
                        "else the bench model). Real runs default to the random-weights bench model, "
                        "conveyor-embedded-llama-40m-random")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="devices per model when simulating")
    p.add_argument("--disaggregate", default=None, metavar="LAYOUTS",
                   help="with --simulate: multi-instance layouts, comma-separated: <n>C[@tp] colocated replicas, "
                        "<x>P<y>D[@tp[/tp_decode]] prefill + decode instances with the KV moved between them, "
                        "e.g. 2C@4,1P1D@4,2P1D@2/4 (TP defaults to --tensor-parallel-size); least-loaded routing")
    p.add_argument("--kv-link", default="nvlink", help="with --disaggregate: the prefill-to-decode link, one of "
                   "conveyor.sim.kv_transfer.LINKS (nvlink, rdma-400g, ethernet-25g, infinite)")
    p.add_argument("--kv-link-gbps", type=float, default=None, help="with --disaggregate: override the link's "
                   "bandwidth (Gb/s per GPU, or in all for a shared link)")
    p.add_argument("--prefill-max-num-batched-tokens", type=int, default=None, help="with --disaggregate: the "
                   "token budget of prefill instances (default: --max-num-batched-tokens); a prefill instance has "
                   "no decodes to protect, so it may take whole prompts")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="with --disaggregate: share of each "
                   "GPU's memory for weights + KV (each instance's KV is what its GPUs have left)")
    p.add_argument("--flush-denormal", action=argparse.BooleanOptionalAction, default=True,
                   help="flush denormal floats to zero on CPU (default: on, for every configuration)")
    p.set_defaults(func=_main)


def sweeps_from_args(ns) -> dict[str, list]:
    """The comma-separated lists of the sweepable flags, parsed."""
    sweeps = {"policies": parse_list(ns.policies, str), "request_rate": parse_list(ns.request_rate, float)}
    for name in ENGINE_SWEEPS:
        sweeps[name] = parse_list(getattr(ns, name), SWEEPS[name][1])
    return sweeps


def base_engine_args(ns, sweeps: dict[str, list]):
    """EngineArgs from the flags, each swept knob at its first value (every run overrides what it sweeps)."""
    from conveyor.engine.args import EngineArgs

    first = {SWEEPS[n][0]: v[0] for n, v in sweeps.items() if v and n != "request_rate"}
    args = EngineArgs.from_cli_args(argparse.Namespace(**{**vars(ns), **first}))
    args.detokenize = False  # token ids in, token ids out: measure the engine
    return args


def _main(ns: argparse.Namespace) -> int:
    from conveyor.bench.report import format_table, write_report

    ns.slo_ms = {k: float(v) for k, v in (kv.split("=") for kv in ns.slo.split(","))} if ns.slo else None
    if getattr(ns, "disaggregate", None) and not ns.simulate:
        raise SystemExit("--disaggregate needs --simulate (the real disaggregated engine is not built yet)")
    sweeps = sweeps_from_args(ns)
    configs = expand_configs(sweeps)
    workload = prepare_workload(load_workload(ns.workload), ns.num_requests, ns.offline)
    print(f"{len(configs)} configurations on {workload.name}: {len(workload.requests)} requests, "
          f"{workload.num_prompt_tokens} prompt + {workload.num_output_tokens} output tokens"
          f"{' (all at once)' if ns.offline else ''}")
    base_args = base_engine_args(ns, sweeps)
    if ns.simulate:
        from conveyor.bench.simulate import run_all_simulated

        cluster_runs = None
        if ns.disaggregate:
            from conveyor.bench.simulate_cluster import cluster_runs
        results = run_all_simulated(ns, base_args, configs, workload, cluster_runs=cluster_runs)
    else:
        from conveyor.models import EMBEDDED_NAME

        base_args.model = base_args.model or EMBEDDED_NAME  # the peers' bench shape (random weights)
        results = run_all(ns, base_args, configs, workload)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results))
    print()
    print(format_table(results))
    plots = []
    if not ns.no_plots:
        from conveyor.bench.plots import write_plots

        plots = write_plots(results, out)
    write_report(results, out, plots)
    print(f"\nwrote {out / 'results.json'}, {out / 'report.md'} and {len(plots)} plots")
    return 0
