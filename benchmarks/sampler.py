#!/usr/bin/env python3
"""The sampler's cost per step against torch's textbook path for the same semantics, alternated in one run.

    python benchmarks/sampler.py [--shapes 32x32000,100x49152] [--scales 3,0.3] [--threads 2]

For each logits shape ([rows, vocab]: a decode batch over the bench model's or SmolLM2's vocabulary), each logit
scale (randn times it: 3 is peaked like a language model, 0.3 nearly flat, which sends top-p to its full-sort
fallback) and each option set, it times ``Sampler.sample`` (conveyor's: inverse-CDF draws, top-k / top-p through
a window, see runner/sampler.py) against the baseline a pure-torch engine runs on CPU (vLLM's ``forward_native``
shape, and conveyor's own sampler before 3aca54e: temperature, a softmax-threshold min-p, torch.topk for top-k
alone, a full sort for top-p, an exponential race over the whole vocabulary), taking turns, best of 5 each, and
prints both and the ratio.
"""

from __future__ import annotations

import argparse
import time

OPTIONS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 0.7, "top_k": 50},
    {"temperature": 0.7, "top_k": 40, "top_p": 0.9},
    {"temperature": 0.7, "min_p": 0.05},
]


def baseline_sample(logits, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                    generator=None):
    """Sampling as a pure-torch engine does it on CPU (same semantics as conveyor's sampler)."""
    import torch

    logits = logits.div_(temperature)
    if min_p:
        probs = logits.softmax(dim=-1)
        logits.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))
    if top_k and top_p >= 1.0:  # top-k alone: a threshold at the k-th largest (torch.topk), no sort
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits.masked_fill_(logits < kth, float("-inf"))
    elif top_k or top_p < 1.0:
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1)
        if top_k:
            kth = sorted_logits[:, vocab - top_k].unsqueeze(1)
            sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
        if top_p < 1.0:
            outside = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
            outside[:, -1] = False
            sorted_logits.masked_fill_(outside, float("-inf"))
        logits = logits.scatter_(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return probs.div_(torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="32x32000,100x49152", help="rows x vocab, comma-separated")
    ap.add_argument("--scales", default="3,0.3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ns = ap.parse_args()

    import torch

    from conveyor.core.sampling_params import SamplingParams
    from conveyor.runner.input_batch import RequestState, SamplingMetadata
    from conveyor.runner.sampler import Sampler

    torch.set_num_threads(ns.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{ns.threads} threads; ms per call, best of {ns.repeats} (taken in turns)")
    print("logits | scale | options | torch baseline | conveyor | speed-up")
    for shape in ns.shapes.split(","):
        rows, vocab = (int(v) for v in shape.split("x"))
        for scale in (float(s) for s in ns.scales.split(",")):
            logits = torch.randn(rows, vocab, generator=gen) * scale
            for opts in OPTIONS:
                params = SamplingParams(**opts)
                reqs = [RequestState(f"r{i}", [1, 2, 3], 3, params, 0, i, 0, None) for i in range(rows)]
                sampler = Sampler([0], seed=0)
                runs = {"baseline": lambda x: baseline_sample(x, generator=gen, **opts),
                        "conveyor": lambda x: sampler.sample(x, SamplingMetadata.build(reqs))}
                best = {name: float("inf") for name in runs}
                for rep in range(ns.repeats + 1):  # the first round warms up
                    for name, fn in runs.items():
                        x = logits.clone()
                        t = time.perf_counter()
                        fn(x)
                        if rep:
                            best[name] = min(best[name], time.perf_counter() - t)
                label = ", ".join(f"{k}={v}" for k, v in opts.items())
                print(f"[{rows}, {vocab}] | {scale:g} | {label} | {best['baseline'] * 1e3:.1f} | "
                      f"{best['conveyor'] * 1e3:.1f} | {best['baseline'] / best['conveyor']:.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
