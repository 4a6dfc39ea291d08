"""One engine step as data, for benchmarks, plots and Prometheus (built only when someone listens)."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.core.outputs import SchedulerOutput, is_decode


@dataclass
class StepRecord:
    """What one step scheduled and what it cost. Times are ``time.monotonic()`` seconds."""

    start: float
    num_reqs: int
    num_prefill_tokens: int  # prompt (or recomputed) tokens
    num_decode_tokens: int
    num_padding_tokens: int  # static/dynamic baselines: pad tokens computed and thrown away
    num_idle_slot_tokens: int  # static/dynamic baselines: finished requests kept decoding
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens (slot timeline)
    num_preempted: int = 0
    end: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_reserved_slots: int = 0  # token slots held by requests (paged: their blocks; slab: whole slabs)
    kv_stored_tokens: int = 0  # tokens actually in the cache
    # Prefix-cache hits taken this step, per admitted request (its prompt tokens served from the cache; 0 for a
    # miss), from SchedulerOutput: the tokens the step did not recompute (docs/prefix-cache.md).
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    num_admitted_tokens: int = 0  # tokens of those requests (prompt, plus outputs for a resumed one): the asked
    # Speculative decoding: proposed tokens this step verified (counted in num_prefill_tokens with their
    # request's last token: a verifying request is a multi-token row), and how many requests verified.
    num_spec_tokens: int = 0
    num_verifying_reqs: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def num_tokens(self) -> int:
        """Every token the forward pass computed, useful or not."""
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_padding_tokens

    @property
    def num_saved_tokens(self) -> int:
        """Prompt tokens this step took from the prefix cache instead of computing them."""
        return sum(self.num_cached_tokens.values())

    def saved_attended_keys(self) -> int:
        """Keys the saved tokens' queries would have attended to: a hit of H tokens at the start of a prompt is
        positions 0..H-1, attending to 1..H keys (causal), H(H+1)/2 in all. With ``models.flops``'s
        (FLOPs per token, FLOPs per attended key) that prices the hit as ``forward_flops(H, 0, H(H+1)/2)``."""
        return sum(h * (h + 1) // 2 for h in self.num_cached_tokens.values())

    def saved_seconds(self) -> float:
        """The saved tokens at this step's measured rate (its duration / tokens it computed): what computing them
        in this step would have added, linearly (attention's growth with position is not in a per-token rate)."""
        n = self.num_tokens
        return self.num_saved_tokens * self.duration / n if n and self.end > self.start else 0.0

    @classmethod
    def before(cls, start: float, out: SchedulerOutput, scheduler) -> StepRecord:
        prefill = decode = 0
        for rid, n in out.num_scheduled_tokens.items():
            req = scheduler.requests.get(rid)
            # The kind of work a token is: a one-token prompt (or last prompt chunk) is prefill work.
            if is_decode(n) and req is not None and req.num_computed_tokens >= req.num_prompt_tokens:
                decode += 1
            else:
                prefill += n
        # A new request's num_computed_tokens at scheduling is its prefix hit (0 for a miss; a resumed preempted
        # request is new to the executor again, and its hit is again what this step does not recompute).
        cached = {n.request_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        admitted = sum(len(n.token_ids) for n in out.scheduled_new_reqs)
        return cls(start, out.num_reqs, prefill, decode, out.num_padding_tokens, out.num_idle_slot_tokens,
                   out.num_scheduled_tokens, len(out.preempted_req_ids), num_cached_tokens=cached,
                   num_admitted_tokens=admitted,
                   num_spec_tokens=sum(map(len, out.scheduled_spec_tokens.values())),
                   num_verifying_reqs=len(out.scheduled_spec_tokens))

    def finish(self, end: float, scheduler) -> None:
        self.end = end
        self.num_running = scheduler.num_running
        self.num_waiting = scheduler.num_waiting
        kv = scheduler.kv
        self.kv_usage = kv.usage()
        self.kv_reserved_slots = kv.num_reserved_slots()
        # tokens whose KV a request still holds: not those evicted, nor those given back outside every window
        self.kv_stored_tokens = sum(r.num_computed_tokens - r.num_evicted_tokens
                                    - kv.num_skipped_blocks(r.request_id) * kv.block_size for r in scheduler.running)
