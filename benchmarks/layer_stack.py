#!/usr/bin/env python3
"""Decode steps with the native decoder-layer stack (models.native_stack) against the per-layer path, same engine.

    python benchmarks/layer_stack.py --model DIR_OR_NAME [--dtype bfloat16] [--batches 1,4,16,32,64] [--steps 40]
                                     [--onednn]

For each batch size: that many requests with 100-token prompts are decoded for ``--steps`` engine steps with the
stack, then without it, then with, then without (interleaved, best of 2, so load on a shared machine hits both
alike); prints ms per step and the ratio. First it checks that both paths give the same greedy tokens and
logprobs on a few prompts (the stack is meant to be bit-identical). ``--onednn`` adds a third path taking its turn
in the same rounds: per layer with every linear on oneDNN (no native GEMM: what bfloat16 ran on CPUs without AMX
before the VDPBF16PS GEMM).
"""

from __future__ import annotations

import argparse
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--onednn", action="store_true", help="also time the per-layer path with oneDNN linears only")
    ns = ap.parse_args()

    import torch

    if ns.threads:
        torch.set_num_threads(ns.threads)
    from conveyor.core.sampling_params import SamplingParams
    from conveyor.engine.llm import LLM

    llm = LLM(ns.model, dtype=ns.dtype, max_num_seqs=256, max_model_len=2048, enable_prefix_caching=False,
              detokenize=False, seed=0)
    eng, net = llm.engine, llm.engine.model
    stack = net.native_stack
    if stack is None:
        print("no native layer stack for this model / dtype / CPU: nothing to compare")
        return 1
    print(f"{eng.model_info.name}, {eng.model_info.dtype}, stack up to {stack.max_rows} rows")

    from conveyor.layers.linear import PackedLinear

    packed = [m for m in net.modules() if isinstance(m, PackedLinear)]
    native_rows = [m.max_rows for m in packed]

    def use(on: bool | None) -> None:
        """True: the stack; False: per layer; None: per layer, every linear on oneDNN."""
        net.native_stack = stack if on else None
        for m, rows in zip(packed, native_rows):
            m.max_rows = 0 if on is None else rows

    prompts = [{"prompt_token_ids": list(range(10 + 7 * i, 60 + 13 * i))} for i in range(8)]
    check = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, logprobs=1)
    runs = []
    for on in (True, False):
        use(on)
        runs.append([(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
                     for o in llm.generate(prompts, check, use_tqdm=False)])
    print("same tokens and logprobs:", runs[0] == runs[1])

    ids = iter(range(10**9))
    modes = (True, False, None) if ns.onednn else (True, False)
    print("batch | stack ms/step | per-layer ms/step | per-layer / stack"
          + (" | oneDNN per-layer ms/step | oneDNN / stack" if ns.onednn else ""))
    for batch in (int(b) for b in ns.batches.split(",")):
        best = {on: float("inf") for on in modes}
        for on in modes * 2:
            use(on)
            for i in range(batch):
                eng.add_request(f"b{next(ids)}", {"prompt_token_ids": list(range(5 + i, 105 + i))},
                                SamplingParams(max_tokens=ns.steps + 10, ignore_eos=True))
            for _ in range(5):
                eng.step()  # prefill and a few decodes: the timed steps below are all decodes
            t = time.perf_counter()
            for _ in range(ns.steps):
                eng.step()
            best[on] = min(best[on], (time.perf_counter() - t) / ns.steps * 1e3)
            while eng.has_unfinished_requests():
                eng.step()
        print(f"{batch:5d} | {best[True]:13.2f} | {best[False]:17.2f} | {best[False] / best[True]:.2f}"
              + (f" | {best[None]:24.2f} | {best[None] / best[True]:.2f}" if ns.onednn else ""))
    use(True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
