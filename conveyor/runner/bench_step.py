"""Micro-benchmark of one ModelRunner step on the embedded bench model.

    python -m conveyor.runner.bench_step [--steps 20] [--backend cpu] [--block-size 16] [--only decode]

Times decode steps at batch 1 / 32 / 100 (context lengths like workload_longtail_v1's) and 2048-token prefill
steps, and prints ms/step and achieved GFLOP/s next to this machine's matmul rate measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from conveyor.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from conveyor.core.sampling_params import SamplingParams
from conveyor.models import EMBEDDED_NAME, load_model
from conveyor.models.flops import forward_flops
from conveyor.runner.model_runner import ModelRunner


def matmul_gflops(m: int, k: int, n: int, reps: int = 20) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - t) / 1e9


class StepDriver:
    """Owns block allocation for synthetic requests; builds the SchedulerOutputs a scheduler would send."""

    def __init__(self, runner: ModelRunner, block_size: int) -> None:
        self.runner, self.bs = runner, block_size
        self.next_block = 0
        self.state: dict[str, list] = {}  # req_id -> [num_tokens, num_computed, num_blocks]
        self.ids = 0

    def _blocks(self, req_id: str, upto: int) -> list[int]:
        st = self.state[req_id]
        need = -(-upto // self.bs) - st[2]
        blocks = list(range(self.next_block, self.next_block + max(need, 0)))
        self.next_block += max(need, 0)
        st[2] += len(blocks)
        return blocks

    def prefill(self, prompt_lens: list[int], chunk: int | None = None) -> tuple[SchedulerOutput, list[str]]:
        so, ids = SchedulerOutput(), []
        for n in prompt_lens:
            rid = f"r{self.ids}"
            self.ids += 1
            self.state[rid] = [n, 0, 0]
            tokens = [random.randrange(100, 32000) for _ in range(n)]
            so.scheduled_new_reqs.append(NewRequestData(rid, tokens, n, SamplingParams(temperature=0.0, max_tokens=4096),
                                                        self._blocks(rid, n), 0))
            so.num_scheduled_tokens[rid] = n
            ids.append(rid)
        so.total_num_scheduled_tokens = sum(prompt_lens)
        return so, ids

    def decode(self, req_ids: list[str]) -> SchedulerOutput:
        so = SchedulerOutput()
        for rid in req_ids:
            st = self.state[rid]
            so.scheduled_cached_reqs.append(CachedRequestData(rid, self._blocks(rid, st[1] + 1), st[1]))
            so.num_scheduled_tokens[rid] = 1
        so.total_num_scheduled_tokens = len(req_ids)
        return so

    def commit(self, so: SchedulerOutput, out) -> None:
        for rid, n in so.num_scheduled_tokens.items():
            self.state[rid][1] += n
        for rid in out.sampled_token_ids:
            self.state[rid][0] += 1

    def finish(self, req_ids) -> None:
        self.runner.execute(SchedulerOutput(finished_req_ids=set(req_ids)))


def run(args) -> None:
    torch.manual_seed(0)
    random.seed(0)
    model, info = load_model(EMBEDDED_NAME)
    runner = ModelRunner(model, info, num_blocks=args.num_blocks, block_size=args.block_size,
                         attention_backend=args.backend)
    print(f"threads {torch.get_num_threads()}; matmul GFLOP/s: 2048^3 {matmul_gflops(2048, 2048, 2048, 5):.0f}, "
          f"[32x512]@[512x1536] {matmul_gflops(32, 512, 1536, 200):.0f}, [100x512]@[512x32000] "
          f"{matmul_gflops(100, 512, 32000, 10):.0f}")
    rng = random.Random(1)
    # Context lengths like the long-tail workload's decode phase: mostly chat (40-400), some RAG (300-1200).
    def contexts(n):
        return [rng.randint(40, 400) if rng.random() < 0.8 else rng.randint(300, 1200) for _ in range(n)]
    cases = [("decode", 1, [300]), ("decode", 32, contexts(32)), ("decode", 100, contexts(100)),
             ("prefill", 1, [2048]), ("prefill", 16, [128] * 16)]
    for kind, batch, lens in cases:
        if args.only and kind != args.only:
            continue
        driver = StepDriver(runner, args.block_size)
        so, ids = driver.prefill(lens)
        if kind == "prefill":
            times = []
            for _ in range(max(2, args.steps // 5)):
                driver.finish(ids)
                driver.state.clear()
                driver.next_block = 0
                so, ids = driver.prefill(lens)
                t = time.perf_counter()
                runner.execute(so)
                times.append(time.perf_counter() - t)
            ctx = [p + 1 for n in lens for p in range(n)]
            flops = forward_flops(runner.model, info, sum(lens), batch, sum(ctx))
        else:
            driver.commit(so, runner.execute(so))
            times = []
            for _ in range(args.steps + 2):
                so = driver.decode(ids)
                t = time.perf_counter()
                out = runner.execute(so)
                times.append(time.perf_counter() - t)
                driver.commit(so, out)
            times = times[2:]
            flops = forward_flops(runner.model, info, batch, batch, sum(driver.state[r][0] for r in ids))
        driver.finish(ids)
        best, med = min(times), sorted(times)[len(times) // 2]
        print(f"{kind:8s} batch {batch:4d} tokens {sum(lens) if kind == 'prefill' else batch:5d} "
              f"avg ctx {sum(lens) / len(lens):7.0f}: {med * 1e3:8.2f} ms/step (best {best * 1e3:8.2f}), "
              f"{flops / med / 1e9:6.1f} GFLOP/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=16384)
    ap.add_argument("--only", choices=["decode", "prefill"], help="run only these cases")
    with torch.inference_mode():
        run(ap.parse_args())


if __name__ == "__main__":
    main()
