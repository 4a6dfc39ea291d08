"""Synthetic workloads: long-tail, uniform and shared-prefix traffic with all-at-once, Poisson or bursty arrivals.

Every generator is seeded and pure Python (``random.Random(seed)``), so a (kind, seed, knobs) triple names one
trace exactly; ``conveyor bench workload ... --out FILE`` writes it in the trace format of ``workload.py``.
Requests are greedy with ``ignore_eos`` and ``max_tokens`` equal to their output length, so every engine does
the same work on them.

Lengths are log-uniform: as many requests between 16 and 32 tokens as between 512 and 1024, which is the shape
of real chat + RAG traffic (many short turns, a long tail of long prompts).
"""

from __future__ import annotations

import math
import random

from conveyor.bench.workload import Workload, WorkloadRequest

GREEDY = {"temperature": 0.0, "ignore_eos": True}
ARRIVALS = ("all-at-once", "poisson", "gamma")


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi] whose logarithm is uniform."""
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # Skip the first ids: special tokens (BOS/EOS/pad) live there in most vocabularies.
    return [rng.randrange(3, vocab_size) for _ in range(n)]


def arrival_times(n: int, arrival: str, rate: float | None, rng: random.Random, burstiness: float = 1.0
                  ) -> list[float]:
    """Arrival times (seconds from the start) of ``n`` requests.

    ``poisson``: exponential gaps at ``rate`` req/s. ``gamma``: gamma gaps with the same mean 1 / rate and shape
    ``burstiness`` (as vLLM's ``--burstiness``): < 1 is burstier than Poisson, 1 is Poisson, > 1 is more
    regular. ``all-at-once``: every request at 0.
    """
    if arrival == "all-at-once":
        return [0.0] * n
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {arrival!r}")
    if not rate or rate <= 0:
        raise ValueError(f"{arrival} arrivals need a rate > 0 req/s")
    shape = 1.0 if arrival == "poisson" else burstiness
    scale = 1.0 / (rate * shape)  # mean gap = shape * scale = 1 / rate
    t, times = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(shape, scale)
        times.append(t)
    return times


def _finish(name: str, reqs: list[tuple[str, list[int], int]], seed: int, arrival: str, rate: float | None,
            rng: random.Random, burstiness: float, notes: str) -> Workload:
    times = arrival_times(len(reqs), arrival, rate, rng, burstiness)
    requests = [WorkloadRequest(i, t, prompt, None, out_len, kind, dict(GREEDY))
                for i, ((kind, prompt, out_len), t) in enumerate(zip(reqs, times))]
    return Workload(name, requests, seed, rate if arrival != "all-at-once" else None, notes)


def longtail(num_requests: int = 100, seed: int = 1, rag_fraction: float = 0.2, arrival: str = "poisson",
             rate: float | None = 4.0, burstiness: float = 1.0, vocab_size: int = 32000) -> Workload:
    """Short chat turns (prompt 16-128, output 16-256) mixed with long RAG prompts (256-1024, output 32-384)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_requests):
        if rng.random() < rag_fraction:
            kind, prompt_len, out_len = "rag", log_uniform(rng, 256, 1024), log_uniform(rng, 32, 384)
        else:
            kind, prompt_len, out_len = "chat", log_uniform(rng, 16, 128), log_uniform(rng, 16, 256)
        reqs.append((kind, random_tokens(rng, prompt_len, vocab_size), out_len))
    return _finish("longtail", reqs, seed, arrival, rate, rng, burstiness,
                   f"long-tail: {rag_fraction:.0%} rag (prompt 256-1024, out 32-384), rest chat (prompt 16-128, "
                   "out 16-256), log-uniform lengths")


def uniform(num_requests: int = 100, seed: int = 1, prompt_len: tuple[int, int] = (64, 256),
            output_len: tuple[int, int] = (32, 128), arrival: str = "poisson", rate: float | None = 4.0,
            burstiness: float = 1.0, vocab_size: int = 32000) -> Workload:
    """Prompt and output lengths uniform in the given inclusive ranges."""
    rng = random.Random(seed)
    reqs = [("uniform", random_tokens(rng, rng.randint(*prompt_len), vocab_size), rng.randint(*output_len))
            for _ in range(num_requests)]
    return _finish("uniform", reqs, seed, arrival, rate, rng, burstiness,
                   f"uniform: prompt {prompt_len[0]}-{prompt_len[1]}, out {output_len[0]}-{output_len[1]}")


def shared_prefix(num_requests: int = 100, seed: int = 1, num_prefixes: int = 4, prefix_len: int = 256,
                  suffix_len: tuple[int, int] = (16, 128), output_len: tuple[int, int] = (16, 128),
                  arrival: str = "poisson", rate: float | None = 4.0, burstiness: float = 1.0,
                  vocab_size: int = 32000) -> Workload:
    """A few system prompts of ``prefix_len`` tokens, each reused by many requests (prefix caching's case)."""
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    reqs = []
    for _ in range(num_requests):
        k = rng.randrange(num_prefixes)
        prompt = prefixes[k] + random_tokens(rng, log_uniform(rng, *suffix_len), vocab_size)
        reqs.append((f"prefix{k}", prompt, log_uniform(rng, *output_len)))
    return _finish("shared_prefix", reqs, seed, arrival, rate, rng, burstiness,
                   f"shared prefix: {num_prefixes} system prompts of {prefix_len} tokens, suffix "
                   f"{suffix_len[0]}-{suffix_len[1]}, out {output_len[0]}-{output_len[1]} (log-uniform)")


def rag(num_requests: int = 100, seed: int = 1, prompt_len: tuple[int, int] = (2048, 7168),
        output_len: tuple[int, int] = (32, 256), arrival: str = "poisson", rate: float | None = 2.0,
        burstiness: float = 1.0, vocab_size: int = 32000) -> Workload:
    """Prefill-heavy: long retrieval-augmented prompts (2k-7k tokens) with short answers (32-256), log-uniform.

    The traffic disaggregated serving is built for: prompt work dwarfs decode work, so colocated prefills keep
    interrupting decodes. The bounds keep prompt + answer within an 8k context (Llama-3's)."""
    rng = random.Random(seed)
    reqs = [("rag", random_tokens(rng, log_uniform(rng, *prompt_len), vocab_size), log_uniform(rng, *output_len))
            for _ in range(num_requests)]
    return _finish("rag", reqs, seed, arrival, rate, rng, burstiness,
                   f"prefill-heavy rag: prompt {prompt_len[0]}-{prompt_len[1]}, out {output_len[0]}-{output_len[1]} "
                   "(log-uniform)")


GENERATORS = {"longtail": longtail, "uniform": uniform, "shared-prefix": shared_prefix, "rag": rag}


def add_workload_parser(sub) -> None:
    p = sub.add_parser("workload", help="generate a synthetic workload trace (long-tail, uniform, shared-prefix, rag)")
    p.add_argument("kind", choices=sorted(GENERATORS))
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    p.add_argument("--request-rate", type=float, default=4.0, help="mean arrivals per second")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: <1 burstier than Poisson")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--rag-fraction", type=float, default=None, help="longtail: share of long RAG prompts (0.2)")
    p.add_argument("--num-prefixes", type=int, default=None, help="shared-prefix: distinct system prompts (4)")
    p.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: tokens per system prompt (256)")
    p.add_argument("--prompt-len", default=None, help="rag, uniform: prompt length bounds LO,HI in tokens")
    p.add_argument("--output-len", default=None, help="rag, uniform: output length bounds LO,HI in tokens")
    p.add_argument("--kv-budget-fraction", type=float, default=None,
                   help="give each request a KV eviction budget (kv_budget_tokens) of this fraction of its prompt")
    p.add_argument("--out", required=True, help="trace file to write (JSON)")
    p.set_defaults(func=_main)


def _main(ns) -> int:
    extra = {} if ns.rag_fraction is None else {"rag_fraction": ns.rag_fraction}
    if extra and ns.kind != "longtail":
        raise SystemExit("--rag-fraction applies to longtail workloads only")
    prefix_knobs = {k: v for k in ("num_prefixes", "prefix_len") if (v := getattr(ns, k)) is not None}
    if prefix_knobs and ns.kind != "shared-prefix":
        raise SystemExit("--num-prefixes and --prefix-len apply to shared-prefix workloads only")
    extra.update(prefix_knobs)
    for knob in ("prompt_len", "output_len"):
        if (value := getattr(ns, knob)) is not None:
            if ns.kind not in ("rag", "uniform"):
                raise SystemExit(f"--{knob.replace('_', '-')} applies to rag and uniform workloads only")
            extra[knob] = tuple(int(x) for x in value.split(","))
    workload = GENERATORS[ns.kind](num_requests=ns.num_requests, seed=ns.seed, arrival=ns.arrival,
                                   rate=ns.request_rate, burstiness=ns.burstiness, vocab_size=ns.vocab_size, **extra)
    if ns.kv_budget_fraction is not None:
        if not 0 < ns.kv_budget_fraction <= 1:
            raise SystemExit("--kv-budget-fraction must be in (0, 1]")
        for r in workload.requests:
            r.params["kv_budget_tokens"] = max(1, int(ns.kv_budget_fraction * r.prompt_len))
    workload.save(ns.out)
    last = workload.requests[-1].arrival_s if workload.requests else 0.0
    print(f"wrote {ns.out}: {len(workload.requests)} requests, {workload.num_prompt_tokens} prompt + "
          f"{workload.num_output_tokens} output tokens, last arrival {last:.1f} s")
    return 0
