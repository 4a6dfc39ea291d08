#!/usr/bin/env python3
"""The int8 KV cache against the model's own dtype on chat prompts: greedy agreement, one engine of each.

    python benchmarks/kv_int8_quality.py [--model M] [--dtype float32] [--tokens 128] [--against int8,auto@bfloat16]

Answers the chat questions of ``conveyor bench kv-eviction`` (through the model's chat template) greedily,
``ignore_eos``, with ``--kv-cache-dtype auto`` and ``int8``, and prints: the share of token positions whose
tokens are identical, the share of answers identical token for token, and the mean share of an answer before it
first departs (docs/kv-cache.md). ``--against`` lists what to hold to the float cache: ``int8`` (the default), or
``KV@DTYPE``, e.g. ``auto@bfloat16``: the whole model in bfloat16, cache included, which says how much agreement
a change of rounding alone leaves on these prompts. Perplexity is ``conveyor bench ppl ... --kv-cache-dtype int8``.
"""

from __future__ import annotations

import argparse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=128, help="answer length")
    ap.add_argument("--against", default="int8", help="KV[@DTYPE],...: each held to the --dtype float cache")
    ns = ap.parse_args()

    from conveyor import LLM, SamplingParams
    from conveyor.bench.kv_eviction import chat_prompts, greedy_agreement

    params = SamplingParams(temperature=0.0, max_tokens=ns.tokens, ignore_eos=True)
    answers = {}
    for variant in ["auto", *ns.against.split(",")]:
        kv, _, dtype = variant.partition("@")
        llm = LLM(ns.model, dtype=dtype or ns.dtype, quantization="none", kv_cache_dtype=kv, max_model_len=1024)
        prompts = [{"prompt_token_ids": p} for p in chat_prompts(llm.tokenizer)]
        answers[variant] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        name = llm.engine.model_info.name
        del llm
    exact = answers.pop("auto")
    positions = sum(len(a) for a in exact)
    print(f"{name} ({ns.dtype}), {len(exact)} chat prompts, {ns.tokens} greedy tokens each, against the auto cache")
    for variant, got in answers.items():
        same_tokens = sum(x == y for a, b in zip(exact, got) for x, y in zip(a, b))
        same_answers, before_first = greedy_agreement(exact, got)
        print(f"{variant}: identical tokens {same_tokens}/{positions} = {same_tokens / positions:.3f}; identical "
              f"answers {same_answers:.2f}; mean share before the first difference {before_first:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
