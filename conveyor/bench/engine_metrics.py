"""Engine-side metrics from per-step records: wasted work, KV waste, concurrency, achieved machine fraction.

PURE PYTHON, like ``metrics.py``, so that any producer of step records can use it. A step is anything with the
``StepRecord`` fields (``start``, ``end``, token counts, ``num_running``, ``kv_reserved_slots``, ...).

- Wasted-token fraction: (padding + idle-slot tokens) / every token the forward passes computed.
- KV waste: 1 - tokens stored / token slots reserved, averaged over steps weighted by step duration (paged
  wastes at most a partly filled last block per request; a slab reserves ``max_model_len`` for everyone).
- Peak concurrency: the most requests holding a slot (running, including a static batch's idle slots) after
  any step; mean batch size: requests per forward pass.
- Useful-slot fraction: of the ``max_num_seqs`` batch slots over the run's duration, the share that computed a
  token someone receives (a running request's prompt or decode; not an idle slot, not an empty slot).
- Achieved fraction of the machine: model FLOPs / wall time / measured matmul rate, and the bytes one step must
  stream (the weights, once per step) / step time / measured bandwidth, averaged over steps by time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    num_steps: int = 0
    busy_s: float = 0.0  # time inside steps (the rest of the run the engine idled, waiting for arrivals)
    computed_tokens: int = 0
    padding_tokens: int = 0
    idle_slot_tokens: int = 0
    wasted_fraction: float = 0.0
    kv_waste: float = 0.0
    mean_kv_usage: float = 0.0
    peak_concurrency: int = 0
    mean_batch_size: float = 0.0
    mean_tokens_per_step: float = 0.0
    preemptions: int = 0
    matmul_fraction: float | None = None
    bandwidth_fraction: float | None = None
    useful_slot_fraction: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _time_weighted(steps, value) -> float:
    total = sum(s.end - s.start for s in steps)
    if total <= 0:
        return sum(value(s) for s in steps) / len(steps) if steps else 0.0
    return sum(value(s) * (s.end - s.start) for s in steps) / total


def engine_stats(steps: list, duration_s: float, model_flops: float | None = None,
                 matmul_gflops: float | None = None, weight_bytes: float | None = None,
                 mem_bandwidth_gbs: float | None = None, max_num_seqs: int | None = None) -> EngineStats:
    """Aggregate step records of one run; the machine fractions need the model's FLOPs / bytes and the roofline."""
    if not steps:
        return EngineStats()
    computed = sum(s.num_tokens for s in steps)
    padding = sum(s.num_padding_tokens for s in steps)
    idle = sum(s.num_idle_slot_tokens for s in steps)
    reserved_steps = [s for s in steps if s.kv_reserved_slots > 0]
    kv_waste = _time_weighted(reserved_steps, lambda s: 1.0 - min(s.kv_stored_tokens, s.kv_reserved_slots)
                              / s.kv_reserved_slots) if reserved_steps else 0.0
    busy = sum(s.end - s.start for s in steps)
    stats = EngineStats(
        num_steps=len(steps), busy_s=busy, computed_tokens=computed, padding_tokens=padding, idle_slot_tokens=idle,
        wasted_fraction=(padding + idle) / computed if computed else 0.0, kv_waste=kv_waste,
        mean_kv_usage=_time_weighted(steps, lambda s: s.kv_usage),
        peak_concurrency=max(max(s.num_running, s.num_reqs) for s in steps),
        mean_batch_size=sum(s.num_reqs for s in steps) / len(steps),
        mean_tokens_per_step=computed / len(steps), preemptions=sum(s.num_preempted for s in steps),
    )
    if model_flops and matmul_gflops and duration_s > 0:
        stats.matmul_fraction = model_flops / duration_s / (matmul_gflops * 1e9)
    if weight_bytes and mem_bandwidth_gbs and busy > 0:
        stats.bandwidth_fraction = weight_bytes * len(steps) / busy / (mem_bandwidth_gbs * 1e9)
    if max_num_seqs and duration_s > 0:
        useful = sum((s.num_reqs - s.num_idle_slot_tokens) * (s.end - s.start) for s in steps)
        stats.useful_slot_fraction = useful / (max_num_seqs * duration_s)
    return stats


def step_dict(s) -> dict:
    """A step record as the plain dict results.json stores."""
    return {k: getattr(s, k) for k in ("start", "end", "num_reqs", "num_prefill_tokens", "num_decode_tokens",
                                       "num_padding_tokens", "num_idle_slot_tokens", "num_running", "num_waiting",
                                       "kv_usage", "kv_reserved_slots", "kv_stored_tokens", "num_preempted",
                                       "num_scheduled_tokens", "num_cached_tokens",
                                       "num_admitted_tokens")}


def slot_intervals(scheduled: list[dict[str, int]]) -> dict[str, tuple[int, int]]:
    """Each request's first and last step index, from every step's ``num_scheduled_tokens``: its occupancy of a
    slot (a preempted request keeps its slot through the gap in this picture)."""
    spans: dict[str, tuple[int, int]] = {}
    for i, step in enumerate(scheduled):
        for rid in step:
            first = spans.get(rid, (i, i))[0]
            spans[rid] = (first, i)
    return spans


def assign_slots(spans: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Give every request the lowest slot free over its whole span (interval colouring, by start step)."""
    busy_until: list[int] = []  # slot -> last step it is taken
    slot_of: dict[str, int] = {}
    for rid, (first, last) in sorted(spans.items(), key=lambda kv: kv[1]):
        slot = next((k for k, until in enumerate(busy_until) if until < first), None)
        if slot is None:
            slot = len(busy_until)
            busy_until.append(last)
        busy_until[slot] = last
        slot_of[rid] = slot
    return slot_of
