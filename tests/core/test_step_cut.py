"""A step cut short (core/policies/step_cut.py's decisions, Scheduler.drop_cut_step's bookkeeping): which steps an
arrival may cut and how far into one, and that a dropped step leaves no count advanced and nothing findable in the
prefix cache that its forward pass never computed."""

from __future__ import annotations

import pytest

from conveyor.core.policies import BATCH_PRIORITY
from conveyor.core.policies.step_cut import OutrankedStepCut, cut_unsafe_reason
from tests.helpers.core import FakeExecutor, make_request, make_scheduler, step


def test_only_an_arrival_that_outranks_every_request_in_the_step_cuts_it():
    policy = OutrankedStepCut(1.0)
    batch_only = policy.cut_threshold([BATCH_PRIORITY, BATCH_PRIORITY])
    assert policy.cuts(batch_only, 0) and not policy.cuts(batch_only, BATCH_PRIORITY)
    mixed = policy.cut_threshold([BATCH_PRIORITY, 0])  # an interactive request rides in it: equals do not cut
    assert not policy.cuts(mixed, 0) and policy.cuts(mixed, -1)
    assert policy.cut_threshold([]) is None and not policy.cuts(None, -(1 << 31))
    assert OutrankedStepCut(0.0).cut_threshold([BATCH_PRIORITY]) is None  # the off switch


def test_the_cut_fraction_bounds_the_layers_a_cut_may_throw_away():
    assert OutrankedStepCut(1.0).cut_layers(12) == 12  # before any layer but the first
    assert OutrankedStepCut(0.5).cut_layers(12) == 6  # at most half the step's layers ran
    assert OutrankedStepCut(0.25).cut_layers(2) == 1  # 1: no layer boundary left to stop at
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        OutrankedStepCut(1.5)


def _findable_beyond_computed(s) -> list[str]:
    """Requests holding a findable block whose tokens are not all computed (must never be, between steps)."""
    bad = []
    for rid, request in s.requests.items():
        for i, block in enumerate(s.kv.blocks_of(rid)):
            if block.block_hash is not None and (i + 1) * s.kv.block_size > request.num_computed_tokens:
                bad.append(rid)
    return bad


def test_a_dropped_step_advances_nothing_and_publishes_nothing_and_its_redo_is_the_same_step():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    ex = FakeExecutor()
    a = make_request("a", prompt_len=20, max_tokens=3, priority=BATCH_PRIORITY)
    s.add_request(a)
    step(s, ex)  # the first chunk (8 tokens, 2 blocks) computed and findable
    assert a.num_computed_tokens == 8 and len(s.kv.pool.cached) == 2
    cut = s.schedule(1.0)  # the second chunk: 2 more blocks made findable at schedule time
    assert len(s.kv.pool.cached) == 4 and cut_unsafe_reason(s, cut) is None
    s.drop_cut_step(cut)
    assert a.num_computed_tokens == 8 and len(s.kv.pool.cached) == 2 and not _findable_beyond_computed(s)
    s.check_invariants()
    # a request with the same prompt now finds only the computed blocks
    twin = make_request("twin", prompt_len=20, max_tokens=3)
    assert s.kv.get_computed_blocks(twin)[1] == 8
    redo = s.schedule(2.0)
    assert redo.num_scheduled_tokens == cut.num_scheduled_tokens and not redo.scheduled_new_reqs
    assert [c.num_computed_tokens for c in redo.scheduled_cached_reqs] == [8]
    s.update(redo, ex.execute(redo), 2.0)  # the redo computes them: findable again
    assert a.num_computed_tokens == 16 and len(s.kv.pool.cached) == 4 and not _findable_beyond_computed(s)
    while s.has_unfinished_requests():
        step(s, ex)
        s.check_invariants()
    uncut, ex2 = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8), FakeExecutor()
    b = make_request("a", prompt_len=20, max_tokens=3, priority=BATCH_PRIORITY)
    uncut.add_request(b)
    while uncut.has_unfinished_requests():
        step(uncut, ex2)
    assert a.output_token_ids == b.output_token_ids and len(a.output_token_ids) == 3


def test_a_step_whose_admission_hit_a_block_the_same_step_publishes_is_not_cut():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    for rid in ("a", "b"):  # the same prompt, admitted in one step: b hits the blocks a's prompt makes findable
        s.add_request(make_request(rid, prompt_len=12, priority=BATCH_PRIORITY))
    out = s.schedule(0.0)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert cut_unsafe_reason(s, out) == "a prefix hit on a block this step makes findable"
