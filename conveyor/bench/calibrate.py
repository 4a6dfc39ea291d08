"""``conveyor sim calibrate``: time the real engine over a grid of step shapes and fit the simulator's profile.

For each (decodes D, context C) of the grid, D requests with distinct random prompts of C tokens are prefilled
(that step is a data point too), then timed: a few decode-only steps, and steps where one new prompt of P
tokens joins the D decodes (prefill tokens x decodes x context). A step's time is the whole ``engine.step()``
(schedule, runner, update, output processing), which is what a request waits for between two tokens. Each
shape is timed ``--repeats`` times and its median kept: the profile describes the machine as it was while
calibrating (calibrate on a quiet machine for a quiet machine's profile). ``--workload TRACE`` adds every step of
a real run of that trace (all requests at once, the configured policy) to the points. The profile JSON holds the
fitted ``Hardware``, the fit's errors, the machine's measured roofline and every measured point, so anyone can
refit or compare machines.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from conveyor.bench.simulate import spec_from_model_dir
from conveyor.sim import SequenceTracker, StepShape
from conveyor.sim.fit import fit_hardware
from conveyor.sim.hardware import Hardware
from conveyor.sim.model_specs import ModelSpec, get_model_spec


@dataclass(frozen=True)
class Grid:
    """The step shapes to time: contexts C x decodes D (with D x C bounded), and prompts P joining them."""

    contexts: tuple[int, ...] = (16, 128, 512, 1536)
    decodes: tuple[int, ...] = (1, 4, 16, 64)
    prefills: tuple[int, ...] = (16, 128, 1024)
    max_batch_context: int = 8192  # D x C: bounds the set-up prefill and the KV cache the grid needs
    decode_steps: int = 3

    def batches(self) -> list[tuple[int, int]]:
        return [(d, c) for c in self.contexts for d in self.decodes if d * c <= self.max_batch_context]

    def quick(self) -> Grid:
        return Grid(self.contexts[::2], self.decodes[::2], self.prefills[::2], self.max_batch_context, 1)


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


class ShapeRecordingExecutor:
    """The real runner, plus the shape of every step it ran (as the simulator's tracker sees it)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.tracker = SequenceTracker()
        self.shapes: list[StepShape] = []

    def execute(self, so):
        self.shapes.append(self.tracker.shape_of(so)[0])
        return self.runner.execute(so)


def measure_points(engine, grid: Grid, seed: int = 0) -> list[tuple[StepShape, float]]:
    """Drive ``engine`` (policy continuous, empty) through the grid; (shape, seconds) of every step."""
    from conveyor.core.sampling_params import SamplingParams

    recorder = ShapeRecordingExecutor(engine.executor)
    engine.executor = recorder
    rng = random.Random(seed)
    vocab = engine.model_info.vocab_size
    points: list[tuple[StepShape, float]] = []

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]}

    def timed_step() -> None:
        t0 = time.perf_counter()
        engine.step()
        points.append((recorder.shapes[-1], time.perf_counter() - t0))

    for decodes, context in grid.batches():
        ids = [engine.add_request(None, prompt(context), SamplingParams(max_tokens=1 << 20, ignore_eos=True))
               for _ in range(decodes)]
        timed_step()  # the whole batch's prefill
        for _ in range(grid.decode_steps):
            timed_step()
        for p in grid.prefills:
            engine.add_request(None, prompt(p), SamplingParams(max_tokens=1, ignore_eos=True))
            timed_step()  # P prefill tokens + D decodes; the newcomer samples once and finishes
        for rid in ids:
            engine.abort_request(rid)
    engine.executor = recorder.runner
    return points


def median_per_shape(points: list[tuple[StepShape, float]]) -> list[tuple[StepShape, float]]:
    by_shape: dict[str, list[tuple[StepShape, float]]] = {}
    for shape, seconds in points:
        by_shape.setdefault(json.dumps(shape.to_list()), []).append((shape, seconds))
    return [(group[0][0], statistics.median(s for _, s in group)) for group in by_shape.values()]


def measure_workload(engine, workload) -> list[tuple[StepShape, float]]:
    """Every step of a real run of ``workload`` (all at once): its shape and the time to the next step's start."""
    from conveyor.bench.online import replay

    recorder = ShapeRecordingExecutor(engine.executor)
    engine.executor = recorder
    try:
        steps = replay(engine, workload.all_at_once()).steps
    finally:
        engine.executor = recorder.runner
    starts = [s.start for s in steps]
    ends = starts[1:] + [steps[-1].end]  # back to back: a step's cycle ends where the next one starts
    return [(shape, end - start) for shape, start, end in zip(recorder.shapes, starts, ends)]


def model_spec_of(model_dir: str | None, loaded_name: str) -> ModelSpec:
    """The simulator's view of the model being timed: its config.json, or the table's entry by name."""
    if model_dir is not None and (Path(model_dir) / "config.json").is_file():
        return spec_from_model_dir(model_dir)
    return get_model_spec(loaded_name)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate(args, repeats: int, quick: bool, workload_path: str | None = None) -> dict:
    """Measure and fit; the profile document."""
    import torch

    from conveyor.bench.machine import measure_roofline
    from conveyor.engine.llm_engine import LLMEngine

    load_before = os.getloadavg()
    torch.set_flush_denormal(True)  # as bench compare does: the random-weights model drifts into denormals
    try:
        engine = LLMEngine(args)
        spec = model_spec_of(args.model, engine.model_info.name)
        grid = Grid().quick() if quick else Grid()
        measure_points(engine, Grid().quick(), seed=99)  # warm-up: first-call costs are no step's cost
        roof = measure_roofline(engine.device)
        points = []
        for r in range(repeats):
            points += measure_points(engine, grid, seed=r)
            print(f"repeat {r + 1}/{repeats}: {len(points)} steps timed")
        points = median_per_shape(points)
        if workload_path:
            from conveyor.bench.workload import load_workload

            points += measure_workload(engine, load_workload(workload_path))
            print(f"{workload_path}: {len(points)} steps in all")
    finally:
        torch.set_flush_denormal(False)
    dtype_bytes = DTYPE_BYTES[engine.model_info.dtype]
    base = Hardware(f"cpu: {cpu_name()}, {torch.get_num_threads()} threads", roof.matmul_gflops * 1e9,
                    roof.mem_bandwidth_gbs * 1e9, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                    dtype_bytes=dtype_bytes, link_bandwidth=0.0,
                    source=f"measured by `conveyor sim calibrate` on {time.strftime('%Y-%m-%d')}: peaks = this "
                           f"run's square fp32 GEMM and copy bandwidth; efficiencies and overheads fitted")
    report = fit_hardware(spec, base, points)
    return {"format": "conveyor-sim-profile/1", "model": asdict(spec), "hardware": report.hardware.to_dict(),
            "fit": report.to_dict(),
            "measured": {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "dtype": args.dtype,
                         "torch_threads": torch.get_num_threads(), "roofline": roof.__dict__,
                         "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "repeats": repeats,
                         "workload": workload_path, "policy": args.policy},
            "points": [[shape.to_list(), seconds] for shape, seconds in points]}


def refit(profile: dict) -> dict:
    """Fit a profile's stored points again (e.g. after the cost model changed), keeping its measured peaks."""
    spec = ModelSpec(**profile["model"])
    points = [(StepShape.from_list(shape), seconds) for shape, seconds in profile["points"]]
    report = fit_hardware(spec, Hardware.from_dict(profile["hardware"]), points)
    return {**profile, "hardware": report.hardware.to_dict(), "fit": report.to_dict()}


def profile_json(profile: dict) -> str:
    """The profile as JSON that diffs well: one key per line, one measured point per line."""
    head = json.dumps({k: v for k, v in profile.items() if k != "points"}, indent=1)
    points = ",\n".join(json.dumps(p) for p in profile["points"])
    return head[:-2] + ',\n "points": [\n' + points + "\n ]\n}\n"


def describe(profile: dict) -> str:
    hw, fit = profile["hardware"], profile["fit"]
    return (f"{hw['name']}, model {profile['model']['name']}: GEMM {hw['matmul_efficiency']:.2f} and attention "
            f"{hw['attention_efficiency']:.2f} of {hw['peak_flops'] / 1e9:.0f} GFLOP/s, memory "
            f"{hw['memory_efficiency']:.2f} of {hw['mem_bandwidth'] / 1e9:.1f} GB/s; overheads "
            f"{hw['step_overhead_s'] * 1e3:.2f} ms/step + {hw['per_request_overhead_s'] * 1e6:.0f} us/request + "
            f"{hw['per_token_overhead_s'] * 1e6:.1f} us/token; fit over {fit['num_points']} steps: rms "
            f"{fit['rms_rel_error']:.1%}, max {fit['max_rel_error']:.1%}")


def add_calibrate_parser(sub) -> None:
    from conveyor.engine.args import EngineArgs
    from conveyor.models import EMBEDDED_NAME

    p = sub.add_parser("calibrate", help="time the real engine over a grid of step shapes; write a sim profile")
    EngineArgs.add_cli_args(p)
    p.set_defaults(model=EMBEDDED_NAME)  # the bench model, as bench compare's real runs (random weights)
    p.add_argument("--out", default="profile.json", help="the profile JSON to write")
    p.add_argument("--repeats", type=int, default=2, help="times each shape is timed (the fastest is kept)")
    p.add_argument("--quick", action="store_true", help="a quarter of the grid (a smoke test, not a profile)")
    p.add_argument("--workload", default=None, help="also fit on every step of a real run of this trace")
    p.add_argument("--refit", default=None, metavar="PROFILE", help="refit a profile's stored points; no timing")
    p.set_defaults(func=_main, kv_cache_memory=2.0, policy="continuous", max_num_batched_tokens=1 << 16)


def _main(ns) -> int:
    from conveyor.engine.args import EngineArgs

    if ns.refit:
        profile = refit(json.loads(Path(ns.refit).read_text()))
    else:
        args = EngineArgs.from_cli_args(ns)
        args.detokenize = False
        profile = calibrate(args, ns.repeats, ns.quick, ns.workload)
    Path(ns.out).write_text(profile_json(profile))
    print(describe(profile))
    print(f"wrote {ns.out}")
    return 0
