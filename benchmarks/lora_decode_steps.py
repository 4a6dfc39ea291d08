#!/usr/bin/env python3
"""Decode-step cost with 8 rank-16 LoRA adapters against none, alternating step by step in one engine, so adjacent
steps see the same machine load (docs/lora.md): every other step's adapter rows are cleared and it runs as the base
model. Prints the median time of the decode-only steps of each kind and their ratio.

    python benchmarks/lora_decode_steps.py [N requests, default 40]

LORA_DTYPE=float32 forces the adapter slots' dtype; NT=k runs k torch threads. Run from the repository root.
"""
import os
import statistics
import sys
import tempfile
import time
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
from lora_throughput import write_adapters
from conveyor import LLM, LoRARequest, SamplingParams

if os.environ.get("LORA_DTYPE"):
    import torch
    import conveyor.models.lora_model as lm
    lm.adapter_dtype = lambda model: getattr(torch, os.environ["LORA_DTYPE"])
n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
llm = LLM(None, dtype="auto", enable_lora=True, max_loras=8, max_lora_rank=16, enable_prefix_caching=False,
          max_model_len=2048, **({"num_threads": int(os.environ["NT"])} if os.environ.get("NT") else {}))
runner = llm.engine.executor
paths = write_adapters(llm.engine.model_info.lora_base, tempfile.mkdtemp(), 8, 16)
loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
count = [0]
prep = runner.lora.prepare
def prepare(step, requests):
    prep(step, requests)
    count[0] += 1
    if count[0] % 2:
        runner.lora.model.step.clear()
runner.lora.prepare = prepare
times = {True: [], False: []}
fwd = runner.forward
def forward(step):
    t0 = time.perf_counter(); out = fwd(step); dt = time.perf_counter() - t0
    rows = len(step.input_ids)
    if 8 <= rows <= 64 and rows == len(step.req_ids):  # decode-only steps
        times[count[0] % 2 == 0].append((rows, dt))
    return out
runner.forward = forward
prompts = [[(7 * i + j) % 1000 + 10 for j in range(20 + i)] for i in range(n)]
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
llm.generate(prompts[:8], params, lora_request=[loras[i % 8] for i in range(8)], use_tqdm=False)  # warm
times = {True: [], False: []}
t0 = time.time()
llm.generate(prompts, params, lora_request=[loras[i % 8] for i in range(n)], use_tqdm=False)
lo, base = times[True], times[False]
ml, mb = statistics.median(d for _, d in lo), statistics.median(d for _, d in base)
# pair adjacent steps of equal rows
print(f"adapter dtype {getattr(runner.lora.model, 'weight_dtype', 'float32 main')}; decode steps: {len(lo)} with adapters, {len(base)} base; "
      f"median ms {1000 * ml:.2f} vs {1000 * mb:.2f}: base/adapters {mb / ml:.3f}; rows {statistics.median(r for r, _ in lo)}; "
      f"{time.time() - t0:.0f} s; load {os.getloadavg()[0]:.2f}")
