"""``conveyor bench step``: one ModelRunner step at a time on the embedded bench model, no scheduler.

    conveyor bench step [--steps 20] [--backend cpu] [--dtype float32] [--block-size 16] [--only decode]

Times decode steps at batch 1 / 32 / 100 (context lengths like workload_longtail_v1's) and 2048-token prefill
steps, and prints ms/step and achieved GFLOP/s next to this machine's matmul rate measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import time

from conveyor.bench.step_builder import StepBuilder

DECODE_CONTEXT_CHAT = (40, 400)  # like the long-tail workload's decode phase: mostly chat turns,
DECODE_CONTEXT_RAG = (300, 1200)  # some RAG prompts
RAG_FRACTION = 0.2
TOKEN_IDS = (100, 32000)  # random prompt tokens: clear of the special ids, inside the bench vocabulary


def _contexts(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(*DECODE_CONTEXT_RAG) if rng.random() < RAG_FRACTION else rng.randint(*DECODE_CONTEXT_CHAT)
            for _ in range(n)]


def _add_requests(builder: StepBuilder, lens: list[int], first_id: int) -> list[str]:
    ids = []
    for i, n in enumerate(lens):
        rid = f"r{first_id + i}"
        builder.add(rid, [random.randrange(*TOKEN_IDS) for _ in range(n)])
        ids.append(rid)
    return ids


def _finish(runner, builder: StepBuilder, ids: list[str]) -> None:
    for rid in ids:
        builder.finish(rid)
    runner.execute(builder.step({}))  # the runner forgets them (outside any timed step)


def _time_prefill(runner, builder: StepBuilder, lens: list[int], repeats: int) -> list[float]:
    times, next_id = [], 0
    for _ in range(repeats):
        ids = _add_requests(builder, lens, next_id)
        next_id += len(ids)
        so = builder.step(dict.fromkeys(ids))
        t = time.perf_counter()
        runner.execute(so)
        times.append(time.perf_counter() - t)
        _finish(runner, builder, ids)
    return times


def _time_decode(runner, builder: StepBuilder, lens: list[int], steps: int) -> tuple[list[float], int]:
    """Decode times after a prefill (the first two steps are warm-up); also the total context at the end."""
    ids = _add_requests(builder, lens, 0)
    builder.run(runner, dict.fromkeys(ids))
    times = []
    for _ in range(steps + 2):
        so = builder.step(dict.fromkeys(ids, 1))
        t = time.perf_counter()
        out = runner.execute(so)
        times.append(time.perf_counter() - t)
        builder.update(so, out)
    context = sum(len(builder.tokens[r]) for r in ids)
    _finish(runner, builder, ids)
    return times[2:], context


def run(args) -> None:
    import torch

    from conveyor.bench.machine import gemm_gflops
    from conveyor.models import EMBEDDED_NAME, load_model
    from conveyor.models.flops import forward_flops
    from conveyor.runner.model_runner import ModelRunner

    torch.manual_seed(0)
    random.seed(0)
    model, info = load_model(EMBEDDED_NAME, dtype=args.dtype)
    runner = ModelRunner(model, info, num_blocks=args.num_blocks, block_size=args.block_size,
                         attention_backend=args.backend)
    print(f"{info.dtype} ({info.dtype_reason}), attention {runner.backend}, threads {torch.get_num_threads()}; matmul GFLOP/s: 2048^3 {gemm_gflops(2048, 2048, 2048):.0f}, "
          f"[32x512]@[512x1536] {gemm_gflops(32, 512, 1536, calls=50):.0f}, [100x512]@[512x32000] "
          f"{gemm_gflops(100, 512, 32000, calls=5):.0f}")
    rng = random.Random(1)
    cases = [("decode", 1, [300]), ("decode", 32, _contexts(rng, 32)), ("decode", 100, _contexts(rng, 100)),
             ("prefill", 1, [2048]), ("prefill", 16, [128] * 16)]
    for kind, batch, lens in cases:
        if args.only and kind != args.only:
            continue
        builder = StepBuilder(args.block_size, args.num_blocks)
        if kind == "prefill":
            times = _time_prefill(runner, builder, lens, max(2, args.steps // 5))
            flops = forward_flops(info, sum(lens), batch, sum(p + 1 for n in lens for p in range(n)))
        else:
            times, context = _time_decode(runner, builder, lens, args.steps)
            flops = forward_flops(info, batch, batch, context)
        best, med = min(times), sorted(times)[len(times) // 2]
        print(f"{kind:8s} batch {batch:4d} tokens {sum(lens) if kind == 'prefill' else batch:5d} "
              f"avg ctx {sum(lens) / len(lens):7.0f}: {med * 1e3:8.2f} ms/step (best {best * 1e3:8.2f}), "
              f"{flops / med / 1e9:6.1f} GFLOP/s")


def add_step_parser(sub) -> None:
    p = sub.add_parser("step", help="time single model steps (decode / prefill) on the embedded bench model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto (the engine's default)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=16384)
    p.add_argument("--only", choices=["decode", "prefill"], help="run only these cases")
    p.set_defaults(func=_main)


def _main(ns: argparse.Namespace) -> int:
    import torch

    with torch.inference_mode():
        run(ns)
    return 0
