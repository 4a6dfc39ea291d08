"""The scheduler's executable invariants (``Scheduler.check_invariants``): run after every step in tests and with
``--debug-invariants``. PURE PYTHON."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.core.scheduler import Scheduler


def check_scheduler(s: Scheduler) -> None:
    """Raise AssertionError unless the KV manager's bookkeeping, the scheduler's queues and the KV evictor's
    tables are consistent with one another."""
    s.kv.check_invariants()
    ids = [r.request_id for r in s.running] + [r.request_id for r in s.waiting]
    assert len(ids) == len(set(ids)), "a request is both running and waiting"
    assert set(ids) <= set(s.requests), "a queued request is not registered"
    assert len(s.running) <= s.config.max_num_seqs, "more running requests than max_num_seqs"
    if s.adapter_slots is not None:
        s.adapter_slots.check_invariants(s.running)
    for request in s.waiting:
        assert not s.kv.block_ids(request.request_id), f"waiting {request.request_id} holds blocks"
    for request in s.running:
        assert request.status.holds_slot, f"running {request.request_id} is {request.status}"
        assert request.num_computed_tokens <= request.num_tokens
    if s.evictor is not None:
        s.evictor.check_invariants(s.kv, s.requests.values(), s.running)
