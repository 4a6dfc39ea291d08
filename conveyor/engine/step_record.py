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

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def num_tokens(self) -> int:
        """Every token the forward pass computed, useful or not."""
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_padding_tokens

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
        return cls(start, out.num_reqs, prefill, decode, out.num_padding_tokens, out.num_idle_slot_tokens,
                   out.num_scheduled_tokens, len(out.preempted_req_ids))

    def finish(self, end: float, scheduler) -> None:
        self.end = end
        self.num_running = scheduler.num_running
        self.num_waiting = scheduler.num_waiting
        kv = scheduler.kv
        self.kv_usage = kv.usage()
        self.kv_reserved_slots = kv.num_reserved_slots()
        self.kv_stored_tokens = sum(r.num_computed_tokens for r in scheduler.running)
