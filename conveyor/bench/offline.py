"""``conveyor bench offline``: every request of a workload submitted at once; wall time and throughput.

Reports wall time, request / output / total token throughput, and what fraction of this machine's measured
matmul rate (in the run's dtype) the run achieved (model FLOPs / wall / measured GFLOP/s), like PEERS.md reports
its peers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from conveyor.bench.workload import Workload, load_workload


class TokenRates:
    """``output_tok_s`` and ``total_tok_s`` (prompt + output) of a run's result, from its ``wall_s`` and counts."""

    wall_s: float
    prompt_tokens: int
    output_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s


@dataclass
class OfflineResult(TokenRates):
    wall_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    num_steps: int
    num_preemptions: int


def workload_work(prompt_tokens: int, output_tokens: int, num_requests: int) -> tuple[int, int, float]:
    """(tokens through the layers, rows through the lm_head, keys attended in all) that a workload needs.

    Every prompt token and every output token but the last of each request passes through the layers; every
    output token is sampled once through the lm_head. Attention is approximated at half the final context.
    """
    computed = prompt_tokens + output_tokens - num_requests
    avg_ctx = (prompt_tokens + output_tokens) / max(num_requests, 1) / 2
    return computed, output_tokens, avg_ctx * computed


def model_flops(info, prompt_tokens: int, output_tokens: int, num_requests: int) -> float:
    """FLOPs the workload needs (``models.flops.forward_flops`` of ``workload_work``)."""
    from conveyor.models.flops import forward_flops  # the models package imports torch: not at CLI start-up

    return forward_flops(info, *workload_work(prompt_tokens, output_tokens, num_requests))


def run_offline(llm, workload: Workload, use_tqdm: bool = False, keep_prefix_cache: bool = False) -> OfflineResult:
    """Submit every request at once and generate to completion; the result counts tokens actually produced.

    The prefix cache is emptied first unless ``keep_prefix_cache``: a repeat of the same workload would
    otherwise find every prompt cached and skip most of the prefill.
    """
    engine = llm.engine
    if not keep_prefix_cache:
        engine.reset_prefix_cache()
    preempt0, steps0 = engine.scheduler.num_preemptions, engine.scheduler.num_steps
    prompts = [r.engine_prompt() for r in workload.requests]
    params = [r.sampling_params() for r in workload.requests]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    wall = time.perf_counter() - t0
    return OfflineResult(
        wall, len(outputs), sum(len(o.prompt_token_ids) for o in outputs), sum(o.num_generated_tokens for o in outputs),
        engine.scheduler.num_steps - steps0, engine.scheduler.num_preemptions - preempt0,
    )


def add_offline_parser(sub) -> None:
    from conveyor.engine.args import EngineArgs
    from conveyor.models import EMBEDDED_NAME

    p = sub.add_parser("offline", help="offline throughput: submit a whole workload at once")
    p.add_argument("--workload", default="longtail_v1", help="a packaged trace's name (longtail_v1) or a "
                   "trace file")
    p.add_argument("--repeats", type=int, default=1, help="timed runs after one warm-up run")
    p.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--keep-prefix-cache", action="store_true",
                   help="let a repeat reuse the previous run's cached prompts (as vllm_offline.py's repeats do)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(model=EMBEDDED_NAME)  # the peers' bench shape (random weights)
    p.set_defaults(func=_main)


def _main(ns) -> int:
    from conveyor.bench.machine import measure_roofline
    from conveyor.engine.args import EngineArgs
    from conveyor.engine.llm import LLM

    workload = load_workload(ns.workload)
    if ns.num_requests:
        workload.requests = workload.requests[: ns.num_requests]
    args = EngineArgs.from_cli_args(ns)
    args.detokenize = False  # token ids in, token ids out: measure the engine, as vLLM's throughput bench can
    t0 = time.perf_counter()
    llm = LLM(**vars(args))
    info = llm.engine.model_info
    print(f"engine ready in {time.perf_counter() - t0:.1f} s: {info.name}, {info.dtype} ({info.dtype_reason}), "
          f"{llm.engine.num_kv_blocks} KV blocks x {args.block_size}, policy {args.policy}")
    if not ns.no_warmup:
        warm = Workload("warmup", workload.requests[:8])
        run_offline(llm, warm)
    results = [run_offline(llm, workload, use_tqdm=True, keep_prefix_cache=ns.keep_prefix_cache)
               for _ in range(ns.repeats)]
    roof = measure_roofline(llm.engine.device, dtype=info.dtype)  # the run's own dtype: bfloat16 vs its own rate
    walls = [r.wall_s for r in results]
    best = min(results, key=lambda r: r.wall_s)
    flops = model_flops(llm.engine.model_info, best.prompt_tokens, best.output_tokens,
                        best.num_requests)
    achieved = flops / best.wall_s / 1e9
    print(f"\nworkload {workload.name}: {best.num_requests} requests, {best.prompt_tokens} prompt + "
          f"{best.output_tokens} output tokens, {flops / 1e12:.2f} TFLOP")
    print(f"wall time        {best.wall_s:8.2f} s   (runs: {', '.join(f'{w:.2f}' for w in walls)}; "
          f"median {statistics.median(walls):.2f})")
    print(f"requests/s       {best.num_requests / best.wall_s:8.2f}")
    print(f"output tok/s     {best.output_tok_s:8.1f}")
    print(f"total tok/s      {best.total_tok_s:8.1f}")
    print(f"steps            {best.num_steps:8d}   preemptions {best.num_preemptions}")
    print(f"machine          {roof.describe()}")
    print(f"achieved         {achieved:8.1f} GFLOP/s = {achieved / roof.matmul_gflops:.0%} of the square-GEMM rate, "
          f"{achieved / roof.skinny_gflops:.0%} of the decode-GEMM rate")
    return 0
