"""``conveyor bench kv-eviction``: what KV eviction (``--kv-eviction``) costs in quality and in step time, on the
real model (SmolLM2-135M-Instruct by default).

- **Streaming perplexity**: a long real text (the Python standard library's own documentation, the topics of
  ``pydoc_data``, which every CPython ships) is fed as one prompt in small chunks (``--chunk`` tokens a step),
  and every token is scored (``prompt_logprobs``) with whatever KV the policy kept from the chunks before it;
  budgets are fractions of the text's length. ``snapkv`` compresses only after a prompt's prefill, so its
  streaming perplexity is the exact cache's by construction: it is not run here, and passkey retrieval measures it.
- **Passkey retrieval**: a five-digit key hidden at a random depth of filler text, asked for at the end; greedy
  answer, exact match.
- **Step cost of scoring** (``--cost``): decode steps with ``h2o`` on and a budget above the context (scores
  computed every step, nothing evicted, so the context is the same) against ``none``.

Every configuration runs on one loaded model (``LLMEngine.sharing_model``), one after another.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time

from conveyor.core.sampling_params import SamplingParams

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def long_text() -> str:
    """A long English text that ships with every CPython: the stdlib's documentation topics (``pydoc_data``)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def run(engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], on_step=None):
    """Generate on ``engine`` (an ``LLMEngine``) until every prompt is done; outputs in prompt order. ``params``:
    one for every prompt, or one each."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, sp) for p, sp in zip(prompts, each)]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if on_step is not None:
            on_step(engine)
    return [done[i] for i in ids]


def peak_blocks(engine, peak: list[int]) -> None:
    """Track the most KV blocks one request held after any step."""
    held = max((len(engine.kv_manager.blocks_of(rid)) for rid in engine.scheduler.requests), default=0)
    peak[0] = max(peak[0], held)


def streaming_ppl(engine, ids: list[int]) -> tuple[float, int, float]:
    """(perplexity over tokens 1.., peak KV blocks of the request, wall seconds) of one streamed prompt."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    peak = [0]
    start = time.perf_counter()
    out = run(engine, [ids], params, lambda e: peak_blocks(e, peak))[0]
    wall = time.perf_counter() - start
    lps = [e.logprob for e in out.prompt_logprobs if e is not None]  # the first token has none
    return math.exp(-sum(lps) / len(lps)), peak[0], wall


def passkey_prompts(tokenizer, length: int, trials: int, seed: int) -> list[tuple[list[int], str]]:
    """``trials`` prompts of about ``length`` tokens, each hiding a key at a random depth, with the key."""
    rng = random.Random(seed)
    filler_ids = len(tokenizer.encode(FILLER))
    reps = max(1, (length - 60) // filler_ids)
    out = []
    for _ in range(trials):
        key = str(rng.randint(10000, 99999))
        depth = rng.randint(0, reps)
        text = ("There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n"
                + FILLER * depth + f"The pass key is {key}. Remember it. {key} is the pass key.\n"
                + FILLER * (reps - depth) + "\nWhat is the pass key? The pass key is")
        out.append((tokenizer.encode(text), key))
    return out


def passkey_accuracy(engine, cases: list[tuple[list[int], str]]) -> float:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = run(engine, [ids for ids, _ in cases], params)
    hits = sum(1 for out, (_, key) in zip(outs, cases) if out.outputs[0].text.strip().startswith(key))
    return hits / len(cases)


CHAT_QUESTIONS = [
    "What is the capital of France, and what is it known for?",
    "Explain how a hash table works to a new programmer.",
    "Write a short poem about the sea.",
    "Give me three tips for writing clear emails.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I reverse a list in Python? Show an example.",
    "What are the health benefits of regular exercise?",
]


def chat_prompts(tokenizer) -> list[list[int]]:
    """The questions above through the model's chat template (plain text where it has none)."""
    from conveyor.engine.chat import chat_prompt

    out = []
    for q in CHAT_QUESTIONS:
        try:
            text = chat_prompt(tokenizer, [{"role": "user", "content": q}])
        except ValueError:
            text = q
        out.append(tokenizer.encode(text))
    return out


def greedy_agreement(exact: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(share of answers token-identical to the exact cache's, mean share of each answer before it departs)."""
    same = sum(a == b for a, b in zip(exact, got)) / len(exact)
    prefix = []
    for a, b in zip(exact, got):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(1, len(a)))
    return same, sum(prefix) / len(prefix)


def plot_quality(path: str, ppl_rows: list[tuple[str, float, float]], passkey_rows: list[tuple[int, str, float, float]],
                 exact_passkey: dict[int, float]) -> None:
    """Quality against memory: perplexity over exact, and passkey accuracy, by policy and budget fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(exact_passkey), figsize=(5 * (1 + len(exact_passkey)), 4))
    axes = list(axes) if len(exact_passkey) else [axes]
    for policy in dict.fromkeys(p for p, _, _ in ppl_rows):
        pts = sorted((f, r) for p, f, r in ppl_rows if p == policy)
        axes[0].plot([100 * f for f, _ in pts] + [100], [100 * (r - 1) for _, r in pts] + [0], "o-", label=policy)
    axes[0].axhline(10, color="grey", ls=":", label="the issue's line (+10%)")
    axes[0].set(xlabel="KV budget, % of the context", ylabel="streaming perplexity over exact, %",
                title="Streaming perplexity", xscale="log")
    for ax, (length, exact) in zip(axes[1:], sorted(exact_passkey.items())):
        for policy in dict.fromkeys(p for n, p, _, _ in passkey_rows if n == length):
            pts = sorted((f, a) for n, p, f, a in passkey_rows if n == length and p == policy)
            ax.plot([100 * f for f, _ in pts] + [100], [a for _, a in pts] + [exact], "o-", label=policy)
        ax.axhline(exact - 0.1, color="grey", ls=":", label="exact - 10 points")
        ax.set(xlabel="KV budget, % of the prompt", ylabel="passkey accuracy", title=f"Passkey, {length} tokens",
               xscale="log", ylim=(-0.05, 1.05))
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def decode_step_ms(engine, prompt: list[int], batch: int, tokens: int) -> float:
    """(median, mean) wall time in ms of the pure decode steps of ``batch`` copies of ``prompt`` generating
    ``tokens`` each (the first 8 left out: warm-up). The mean is what a policy that scores one step in k costs
    on average; the median is an unscored step's."""
    times = []
    engine.step_listeners.append(lambda rec: times.append(rec.duration) if rec.num_prefill_tokens == 0 else None)
    prompts = [prompt[:-1] + [prompt[-1] + i] for i in range(batch)]  # no prefix hits between them
    run(engine, prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    engine.step_listeners.pop()
    return 1000 * statistics.median(times[8:]), 1000 * statistics.fmean(times[8:])


def add_kv_eviction_parser(sub) -> None:
    from conveyor.engine.args import EngineArgs

    p = sub.add_parser("kv-eviction", help="KV eviction policies: streaming perplexity, passkey retrieval and "
                                           "the step cost of scoring, by policy and budget")
    p.add_argument("--tokens", type=int, default=2048, help="streamed text length in tokens")
    p.add_argument("--chunk", type=int, default=32, help="tokens of the text fed per step")
    p.add_argument("--policies", default="sink,h2o", help="policies of both tables (h2o:sum ranks by accumulated "
                                                            "mass; snapkv runs in the passkey table only)")
    p.add_argument("--fractions", default="0.5,0.25,0.125", help="budgets, as fractions of the context")
    p.add_argument("--passkey-lengths", default="", help="passkey prompt lengths in tokens, e.g. 1024,2048 "
                                                         "(empty: skip)")
    p.add_argument("--passkey-trials", type=int, default=8)
    p.add_argument("--chat-tokens", type=int, default=0, help="greedy agreement with the exact cache on chat "
                                                               "prompts answered with N tokens (0: skip)")
    p.add_argument("--plot", default=None, help="write a PNG of quality against KV budget here")
    p.add_argument("--cost", action="store_true", help="time decode steps with h2o scoring against none")
    p.add_argument("--trace", type=int, default=0, help="run a long-context RAG trace of N requests with and "
                                                        "without eviction at equal KV memory (0: skip)")
    p.add_argument("--trace-prompt-len", default="2048,6144", help="trace prompt length bounds in tokens")
    p.add_argument("--trace-output-len", default="200,800", help="trace answer length bounds in tokens")
    p.add_argument("--trace-configs", default="none,none@fit,h2o",
                   help="trace configurations: a policy (none, h2o, h2o:sum, sink, snapkv), optionally @K (at most K "
                        "requests running) or @fit (as many as the pool holds whole: the exact cache never preempts), "
                        "optionally +int8 (an int8 KV cache of the same bytes: more blocks)")
    p.add_argument("--trace-fraction", type=float, default=0.25, help="each trace request's budget, as a "
                                                                       "fraction of its prompt's length")
    p.add_argument("--trace-kv-blocks", type=int, default=None, help="the KV pool of every trace "
                                                                      "configuration, in blocks (default: three "
                                                                      "of the longest possible requests)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_main, enable_prefix_caching=False)


def _engine(base, ns, **knobs):
    from conveyor.engine.args import EngineArgs
    from conveyor.engine.llm_engine import LLMEngine

    args = dataclasses.replace(EngineArgs.from_cli_args(ns), **knobs)
    return LLMEngine.sharing_model(base, args) if base is not None else LLMEngine(args)


def _policy_knobs(name: str) -> dict:
    """Engine knobs of a policy as ``--policies`` names it: ``h2o:sum`` is h2o ranking by accumulated mass."""
    policy, _, rank = name.partition(":")
    return dict(kv_eviction=policy, **({"kv_h2o_rank": rank} if rank else {}))


def _trace_config(name: str, fit: int) -> tuple[dict, str]:
    """Engine knobs and a label of one ``--trace-configs`` entry: a policy (``none``, ``h2o``, ``h2o:sum``, ...),
    optionally ``@K`` (at most K requests running) or ``@fit`` (as many as the pool holds at full length, so
    that the exact cache never preempts); ``+int8`` is read by ``_trace``."""
    policy, _, seqs = name.removesuffix("+int8").partition("@")
    knobs = {} if policy == "none" else _policy_knobs(policy)
    if seqs:
        knobs["max_num_seqs"] = fit if seqs == "fit" else int(seqs)
    label = "none (exact)" if policy == "none" else policy
    return knobs, label + (f", at most {knobs['max_num_seqs']} running" if seqs else "")


def _trace(base, ns, prompt_len: tuple[int, int], output_len: tuple[int, int], longest: int) -> None:
    from conveyor.bench.kv_eviction_trace import print_header, print_row, rag_cases, run_trace

    bs = ns.block_size
    per_request = -(-longest // bs)
    blocks = ns.trace_kv_blocks or 3 * per_request
    cases = rag_cases(base.tokenizer.encode(long_text()), ns.trace, prompt_len, output_len)
    print(f"\nlong-context trace: {ns.trace} requests at once, prompts {prompt_len[0]}-{prompt_len[1]} tokens of "
          f"the same text, answers {output_len[0]}-{output_len[1]} (greedy, ignore_eos); every configuration "
          f"with a KV pool of {blocks} blocks ({blocks * bs} tokens); evicting ones keep "
          f"{100 * ns.trace_fraction:g}% of each prompt's length; ratios against the first exact row\n")
    print_header()
    baseline = None
    for name in [c for c in ns.trace_configs.split(",") if c]:
        pool = blocks
        if name.endswith("+int8"):  # the same bytes of int8 rows: more blocks
            pool = blocks * _block_bytes(base, bs, ns.kv_cache_dtype) // _block_bytes(base, bs, "int8")
        knobs, label = _trace_config(name, max(1, pool // per_request))
        evicting = "kv_eviction" in knobs
        if evicting:
            label += f", {100 * ns.trace_fraction:g}%"
        if name.endswith("+int8"):
            knobs["kv_cache_dtype"] = "int8"
            label += f", int8 KV ({pool} blocks)"
        engine = _engine(base, ns, num_kv_blocks=pool, max_model_len=longest, **knobs)
        result = run_trace(engine, cases, ns.trace_fraction if evicting else None, label)
        if baseline is None and not evicting:
            baseline = result
        print_row(result, baseline or result)


def _block_bytes(base, block_size: int, kv_cache_dtype: str) -> int:
    from conveyor.runner.model_runner import ModelRunner

    return ModelRunner.kv_cache_bytes_per_block(base.model_info, block_size, kv_cache_dtype)


def _chat_agreement(base, ns, policies: list[str], fractions: list[float]) -> None:
    prompts = chat_prompts(base.tokenizer)
    params = SamplingParams(max_tokens=ns.chat_tokens, temperature=0.0, ignore_eos=True)
    knobs = dict(max_model_len=base.max_model_len)
    exact = [o.outputs[0].token_ids for o in run(_engine(base, ns, **knobs), prompts, params)]
    print(f"\ngreedy agreement with the exact cache: {len(prompts)} chat prompts "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens), {ns.chat_tokens} tokens each; the budget "
          f"is a fraction of prompt + answer\n")
    print("| policy | budget | identical answers | mean share before the first difference |")
    print("|---|---|---|---|")
    for policy in policies + ["snapkv"] * ("snapkv" not in policies):
        for f in fractions:
            # each its own budget: a fraction of its own context
            budgeted = [dataclasses.replace(params, kv_budget_tokens=max(1, int(f * (len(p) + ns.chat_tokens))))
                        for p in prompts]
            got = [o.outputs[0].token_ids for o in run(_engine(base, ns, **_policy_knobs(policy), **knobs), prompts,
                                                       budgeted)]
            same, prefix = greedy_agreement(exact, got)
            print(f"| {policy} | {100 * f:g}% | {same:.2f} | {prefix:.2f} |", flush=True)


def _main(ns) -> int:
    fractions = [float(f) for f in ns.fractions.split(",") if f]
    policies = [p for p in ns.policies.split(",") if p]
    lengths = [int(x) for x in ns.passkey_lengths.split(",") if x]
    trace_prompt = tuple(int(x) for x in ns.trace_prompt_len.split(","))
    trace_output = tuple(int(x) for x in ns.trace_output_len.split(","))
    trace_len = trace_prompt[1] + trace_output[1] if ns.trace else 0
    longest = max([ns.tokens, *lengths, 2048 if ns.cost else 0, trace_len])  # --cost streams 2,048 tokens
    base = _engine(None, ns, max_model_len=max(ns.max_model_len or 0, longest + 64))
    info = base.model_info
    ids = base.tokenizer.encode(long_text())[:ns.tokens]
    print(f"model {info.name} ({info.dtype}), block size {ns.block_size}, text: pydoc_data topics, "
          f"{len(ids)} tokens fed {ns.chunk} a step")
    bs = ns.block_size
    streaming = dict(max_num_batched_tokens=ns.chunk, max_model_len=base.max_model_len)
    exact, peak, wall = streaming_ppl(_engine(base, ns, **streaming), ids)
    print("| policy | budget | budget tokens | perplexity | vs exact | peak KV tokens | wall s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| none (exact) | 100% | {len(ids)} | {exact:.3f} | - | {peak * bs} | {wall:.1f} |")
    ppl_rows, passkey_rows, exact_passkey = [], [], {}
    for policy in [p for p in policies if p != "snapkv"]:
        for f in fractions:
            budget = int(f * len(ids))
            ppl, peak, wall = streaming_ppl(_engine(base, ns, **_policy_knobs(policy), kv_budget_tokens=budget,
                                                    **streaming), ids)
            ppl_rows.append((policy, f, ppl / exact))
            print(f"| {policy} | {100 * f:g}% | {budget} | {ppl:.3f} | {100 * (ppl / exact - 1):+.1f}% | "
                  f"{peak * bs} | {wall:.1f} |", flush=True)
    if lengths:
        print("\n| length | policy | budget | passkey accuracy |")
        print("|---|---|---|---|")
    for length in lengths:
        cases = passkey_prompts(base.tokenizer, length, ns.passkey_trials, seed=length)
        knobs = dict(max_model_len=base.max_model_len)
        exact_passkey[length] = passkey_accuracy(_engine(base, ns, **knobs), cases)
        print(f"| {length} | none (exact) | 100% | {exact_passkey[length]:.2f} |")
        for policy in policies + ["snapkv"] * ("snapkv" not in policies):
            for f in fractions:
                acc = passkey_accuracy(_engine(base, ns, **_policy_knobs(policy), kv_budget_tokens=int(f * length),
                                               **knobs), cases)
                passkey_rows.append((length, policy, f, acc))
                print(f"| {length} | {policy} | {100 * f:g}% | {acc:.2f} |", flush=True)
    if ns.chat_tokens:
        _chat_agreement(base, ns, policies, fractions)
    if ns.plot:
        plot_quality(ns.plot, ppl_rows, passkey_rows, exact_passkey)
        print(f"\nwrote {ns.plot}")
    if ns.trace:
        _trace(base, ns, trace_prompt, trace_output, trace_len)
    if ns.cost:
        # the same 1,024-token context in every column: h2o with a budget above it scores and evicts nothing;
        # "evicted" runs sink on a 2,048-token prompt kept to 1,024 (every step's KV slots shifted below positions)
        text_ids = base.tokenizer.encode(long_text())[:2048]
        prompt, knobs = text_ids[:1024], dict(max_model_len=base.max_model_len)
        print("\nms per decode step, median / mean (the mean's change against none)")
        print("\n| batch | none | h2o, score every step (default) | h2o, every 8th | sink, 2,048 prompt kept to "
              "1,024 |")
        print("|---|---|---|---|---|")
        configs = [({}, prompt), (dict(kv_eviction="h2o", kv_budget_tokens=8192, kv_score_period=1), prompt),
                   (dict(kv_eviction="h2o", kv_budget_tokens=8192, kv_score_period=8), prompt),
                   (dict(kv_eviction="sink", kv_budget_tokens=1024), text_ids)]
        for batch in (1, 4):
            # the configurations take turns, 3 rounds; each keeps its fastest round (the machine is shared)
            best = [(math.inf, math.inf)] * len(configs)
            for _ in range(3):
                for j, (cfg, p) in enumerate(configs):
                    got = decode_step_ms(_engine(base, ns, **cfg, **knobs), p, batch, 40)
                    best[j] = (min(best[j][0], got[0]), min(best[j][1], got[1]))
            (off_med, off_mean) = best[0]
            print(f"| {batch} | {off_med:.2f} / {off_mean:.2f} | " + " | ".join(
                f"{med:.2f} / {mean:.2f} ({100 * (mean / off_mean - 1):+.0f}%)" for med, mean in best[1:]) + " |",
                flush=True)
    return 0
