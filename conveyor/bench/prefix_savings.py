"""What the prefix cache saved in one run, from its step records: tokens, FLOPs, seconds, hit rate, top prefixes.

PURE PYTHON (like ``engine_metrics``): any producer of ``StepRecord``s (the real engine, the simulator) works.

- saved tokens: prompt tokens admitted requests took from the cache instead of computing (``num_cached_tokens``
  of each step: a new request's computed count at its admission).
- saved FLOPs: each hit of H tokens priced as the forward pass it skipped, ``flops_per_token * H + flops_per_key *
  H(H+1)/2`` (linear layers, plus causal attention over the hit's own positions; no lm_head: a hit samples
  nothing). The two coefficients come from the model: ``models.flops`` on a loaded model, ``ModelSpec`` in the
  simulator, the same counts their ``forward_flops`` use.
- saved seconds: per step, its saved tokens at that step's measured rate (duration / tokens it computed). On a
  machine where small steps are bound by streaming the weights (a GPU), a step's average time per token is far
  above what one more token costs, so this overstates; ``saved_seconds_at_peak`` prices every saved token at the
  run's fastest step (most tokens per second), a lower bound. The truth lies between.
- hit rate: saved tokens / tokens of the requests admitted (a resumed, preempted request counts again), which is
  what the cache served of what was asked at admission; vLLM's ``prefix_cache_hits / prefix_cache_queries`` counts
  a lookup that found no room and retried twice, so it can differ under pressure (both are in the results).
- by prefix: requests grouped by the key of their prompt's first block (``hash_block``), top N by prompt tokens,
  each with its hit rate at first admission. Only the report has it: a label per prefix on /metrics would be
  unbounded cardinality.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from conveyor.core.block_pool import hash_block
from conveyor.core.interfaces import KVManager


@dataclass
class PrefixSavings:
    admitted_tokens: int = 0
    saved_tokens: int = 0
    hit_rate: float = 0.0
    saved_flops: float = 0.0
    saved_seconds: float = 0.0
    saved_seconds_at_peak: float = 0.0  # the saved tokens at the run's fastest measured tokens/s (a lower bound)
    busy_s: float = 0.0  # time inside steps, for scale: saved_seconds / busy_s is the prefill time not spent
    lookup_queries: int | None = None  # the KV manager's per-lookup counters (vLLM's queries / hits)
    lookup_hits: int | None = None
    evictions: int | None = None  # cached blocks whose KV was given up for reuse
    top_prefixes: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def prefix_savings(steps: list, flops_per_token: float, flops_per_key: float,
                   prompts: dict[str, list[int]] | None = None, block_size: int = 16, top_n: int = 5,
                   kv: KVManager | None = None) -> PrefixSavings:
    """Aggregate a run's step records. ``prompts`` (request id -> prompt ids) enables the by-prefix table; ``kv``
    (the run's KV manager) adds its lookup counters and eviction count."""
    out = PrefixSavings()
    first_seen: dict[str, int] = {}
    peak = 0.0  # tokens per second of the fastest step
    for s in steps:
        if s.end > s.start:
            peak = max(peak, s.num_tokens / (s.end - s.start))
        cached = s.num_cached_tokens
        out.admitted_tokens += s.num_admitted_tokens
        out.saved_tokens += sum(cached.values())
        out.saved_flops += flops_per_token * s.num_saved_tokens + flops_per_key * s.saved_attended_keys()
        out.saved_seconds += s.saved_seconds()
        out.busy_s += s.end - s.start
        for rid, hit in cached.items():
            first_seen.setdefault(rid, hit)
    out.hit_rate = out.saved_tokens / out.admitted_tokens if out.admitted_tokens else 0.0
    out.saved_seconds_at_peak = out.saved_tokens / peak if peak else 0.0
    if kv is not None:
        out.lookup_queries, out.lookup_hits, out.evictions = kv.prefix_queries, kv.prefix_hits, kv.prefix_evictions
    if prompts:
        out.top_prefixes = top_prefixes(first_seen, prompts, block_size, top_n)
    return out


def top_prefixes(first_hit: dict[str, int], prompts: dict[str, list[int]], block_size: int, n: int) -> list[dict]:
    """Requests grouped by their first block's key: the ``n`` groups with the most prompt tokens, hit rates."""
    groups: dict[bytes, dict] = {}
    for rid, hit in first_hit.items():
        prompt = prompts.get(rid)
        if prompt is None or len(prompt) < block_size:
            continue  # no full first block: nothing it could share
        key = hash_block(None, prompt[:block_size])
        g = groups.setdefault(key, {"prefix": key.hex()[:12], "requests": 0, "prompt_tokens": 0, "saved_tokens": 0})
        g["requests"] += 1
        g["prompt_tokens"] += len(prompt)
        g["saved_tokens"] += hit
    ranked = sorted(groups.values(), key=lambda g: -g["prompt_tokens"])[:n]
    for g in ranked:
        g["hit_rate"] = g["saved_tokens"] / g["prompt_tokens"] if g["prompt_tokens"] else 0.0
    return ranked


def format_top_prefixes(rows: list[dict]) -> list[str]:
    """Markdown lines of the by-prefix table."""
    lines = ["| first-block key | requests | prompt tokens | saved tokens | hit rate |", "|---|---|---|---|---|"]
    lines += [f"| `{r['prefix']}` | {r['requests']} | {r['prompt_tokens']} | {r['saved_tokens']} | "
              f"{r['hit_rate']:.0%} |" for r in rows]
    return lines
