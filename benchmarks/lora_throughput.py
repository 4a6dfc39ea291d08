#!/usr/bin/env python3
"""Many LoRA adapters in one batch against none, on the long-tail trace, in one engine and one run.

    python benchmarks/lora_throughput.py [--model SmolLM2-135M-Instruct] [--workload longtail_v1] \
        [--num-requests N] [--adapters 8] [--rank 16] [--rounds 3] [--dtype auto]

Writes ``--adapters`` random PEFT LoRA adapters of rank ``--rank`` on all seven projections (q/k/v/o, gate/up/down)
of the model's shape (adapter_config.json + adapter_model.safetensors, as peft saves them), then runs the trace
(every request at t=0, greedy, ``ignore_eos``, prefix caching off) in one ``LLM(enable_lora=True,
max_loras=adapters)`` three ways, taking turns in every round so the machine's noise hits all alike:

- ``base``: no request has an adapter (the native layer stack runs decode steps, as without ``--enable-lora``);
- ``segmented``: request i runs adapter i % N: the base GEMMs once for all rows, then one native call per linear
  layer adds every adapter's low-rank product (csrc/lora.cpp; inside the native layer stack for decode steps);
- ``loop``: the same requests with the adapters' products in a torch loop, one adapter after another (and the
  per-layer path for every step with adapter rows).

``--modes``: which of the three to run (e.g. ``base,segmented`` for a shorter run).

Prints output tokens/s of each (best of the rounds), the ratios segmented / base and loop / base per round, and
the load average. ``--num-requests N``: the trace's first N requests only (a shorter run on a busy machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(lora_base, root: str, count: int, rank: int, seed: int = 0) -> list[str]:
    """``count`` random rank-``rank`` adapters of ``lora_base``'s shapes, in peft's file layout."""
    import torch
    from safetensors.torch import save_file

    paths = []
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        path = os.path.join(root, f"adapter{i}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for layer in range(lora_base.num_layers):
            for module in ALL:
                fan_in, fan_out = lora_base.shapes[module]
                kind = "self_attn" if module in ALL[:4] else "mlp"
                key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(ALL),
                       "bias": "none", "task_type": "CAUSAL_LM"}, f)
        paths.append(path)
    return paths


def run_once(llm, workload, loras) -> tuple[float, int]:
    """Seconds to run the whole trace (all at t=0) and output tokens produced."""
    from conveyor import SamplingParams

    prompts = [r.engine_prompt() for r in workload.requests]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in workload.requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--workload", default="longtail_v1")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--modes", default="base,segmented,loop", help="which of base, segmented, loop to run")
    args = p.parse_args()

    from conveyor import LLM, LoRARequest
    from conveyor.bench.workload import Workload, load_workload

    workload = load_workload(args.workload)
    if args.num_requests:
        workload = Workload(workload.name + f"[:{args.num_requests}]", workload.requests[:args.num_requests])
    llm = LLM(args.model, dtype=args.dtype, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              enable_prefix_caching=False, max_model_len=2048)
    info = llm.engine.model_info
    root = tempfile.mkdtemp(prefix="lora-bench-")
    paths = write_adapters(info.lora_base, root, args.adapters, args.rank)
    loras = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(paths)]
    assigned = [loras[i % len(loras)] for i in range(len(workload.requests))]
    step = llm.engine.executor.lora.model.step
    kernels = step.kernels

    def base():
        return run_once(llm, workload, None)

    def segmented():
        step.kernels = kernels
        return run_once(llm, workload, assigned)

    def loop():
        step.kernels = None
        try:
            return run_once(llm, workload, assigned)
        finally:
            step.kernels = kernels

    cells = {name: fn for name, fn in (("base", base), ("segmented", segmented), ("loop", loop))
             if name in args.modes.split(",")}
    warm = Workload(workload.name, workload.requests[:16])  # warm-up: first calls, adapters read into their slots
    run_once(llm, warm, None)
    run_once(llm, warm, assigned[:16])
    results: dict[str, list[float]] = {name: [] for name in cells}
    for r in range(args.rounds):
        order = list(cells) if r % 2 == 0 else list(reversed(cells))
        for name in order:
            seconds, tokens = cells[name]()
            results[name].append(tokens / seconds)
        ratios = "".join(f"; {n}/base {results[n][-1] / results['base'][-1]:.3f}" for n in cells
                         if n != "base" and "base" in cells)
        print(f"round {r + 1}: " + ", ".join(f"{n} {results[n][-1]:.1f} tok/s" for n in cells) + ratios
              + f"; load {os.getloadavg()[0]:.2f}", flush=True)
    best = {n: max(v) for n, v in results.items()}
    summary = {"model": info.name, "dtype": info.dtype, "workload": workload.name, "adapters": args.adapters,
               "rank": args.rank, "rounds": args.rounds, "best_tok_s": {n: round(v, 1) for n, v in best.items()},
               "load_avg": os.getloadavg(), "cpu": platform.processor() or platform.machine()}
    for a, b in (("segmented", "base"), ("loop", "base"), ("segmented", "loop")):
        if a in best and b in best:
            summary[f"{a}_over_{b}"] = round(best[a] / best[b], 3)
            summary[f"per_round_{a}_over_{b}"] = [round(x / y, 3) for x, y in zip(results[a], results[b])]
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
