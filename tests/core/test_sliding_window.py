"""Sliding windows in the KV manager (``core.sliding_window``): blocks outside every window go back to the pool as
a request advances, the table's entries become the null block (and the executor is told), prefix hits need only
the window's blocks. (The randomized drives with windows: tests/core/test_scheduler.py, test_block_pool.py.)"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core.block_pool import cdiv
from conveyor.core.sliding_window import SlidingWindow, freeable_window
from tests.helpers.core import FakeExecutor, TableMirror, make_request, make_scheduler, step


def test_only_a_model_windowed_on_every_layer_frees_anything():
    assert freeable_window((8, 8)) == 8
    assert freeable_window((4, 8, 4)) == 8  # the largest window: no layer reads before it
    assert freeable_window((8, 0, 8)) == 0  # a global layer (Gemma 3, Ministral) reads every key
    assert freeable_window(()) == 0  # no windows at all
    assert freeable_window((8, 8), ()) == 0  # a full-attention draft model shares the tables
    assert freeable_window((8, 8), (16,)) == 16


def test_skipped_blocks_are_those_before_the_first_key_of_the_next_query():
    w = SlidingWindow(6, 4)  # the query at p sees keys p - 5 .. p
    assert [w.num_skipped_blocks(p) for p in (0, 5, 8, 9, 12, 13, 14)] == [0, 0, 0, 1, 1, 2, 2]


@settings(max_examples=200, deadline=None)
@given(cached=st.lists(st.booleans(), max_size=24), window=st.integers(1, 20), block_size=st.sampled_from([1, 2, 4]))
def test_longest_hit_is_the_longest_prefix_whose_window_is_cached(cached, window, block_size):
    w = SlidingWindow(window, block_size)
    hashes = [bytes([i]) for i in range(len(cached))]
    blocks = {h: f"b{h[0]}" for h, c in zip(hashes, cached) if c}
    hit = w.longest_hit(hashes, blocks.get, None)
    # brute force: the largest k whose last block, and every block from the first one its window needs, are cached
    best = max((k for k in range(1, len(cached) + 1)
                if cached[k - 1] and all(cached[w.num_skipped_blocks(k * block_size):k])), default=0)
    assert len(hit) == best
    skipped = w.num_skipped_blocks(best * block_size)
    assert hit == [None] * skipped + [f"b{i}" for i in range(skipped, best)]


def held(s, rid: str) -> list[int]:
    """The blocks a request really holds (its table without the null entries)."""
    return [b for b in s.kv.block_ids(rid) if b != s.kv.null_block_id]


def test_a_long_request_holds_its_window_not_its_history():
    window, bs, chunk = 10, 4, 8
    s = make_scheduler(num_blocks=64, block_size=bs, max_num_batched_tokens=chunk, sliding_window=window)
    s.add_request(make_request("a", prompt_len=100, max_tokens=40))
    ex = TableMirror(null_block_id=s.kv.null_block_id)
    most = 0
    while s.has_unfinished_requests():
        r = s.requests["a"]
        before = r.num_computed_tokens
        out, _ = step(s, ex)
        s.check_invariants()
        if s.has_unfinished_requests():
            table = s.kv.block_ids("a")
            assert ex.tables["a"] == table  # the executor's copy says null where the pool got the block back
            skipped = SlidingWindow(window, bs).num_skipped_blocks(before)
            assert table[:skipped] == [s.kv.null_block_id] * skipped and s.kv.null_block_id not in table[skipped:]
            most = max(most, len(held(s, "a")))
    assert most <= cdiv(window - 1 + chunk, bs) + 1  # the window behind the step's first token, and the step's
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks


def test_a_prefix_hit_needs_only_the_window_and_survives_the_eviction_of_early_blocks():
    """A request's early blocks go back first, so they are the first evicted: a lookup that needed the chain
    from its first block would find nothing; the windowed one finds the whole prompt through its last window."""
    s = make_scheduler(num_blocks=20, block_size=4, max_num_batched_tokens=16, sliding_window=8)
    ex = FakeExecutor()
    a = make_request("a", prompt_len=41, max_tokens=1)
    s.add_request(a)
    while s.has_unfinished_requests():
        step(s, ex)
    s.add_request(make_request("filler", prompt_len=60, max_tokens=1, first_token=500))
    while s.has_unfinished_requests():
        step(s, ex)  # 15 blocks taken from the head of the free list: the never used ones, then a's first ones
    assert s.kv.pool.lookup(a.block_hashes[0]) is None
    b = make_request("b", prompt_len=41, max_tokens=2)
    s.add_request(b)
    out, _ = step(s, ex)
    s.check_invariants()
    assert b.num_cached_prompt_tokens == 40 and out.num_scheduled_tokens == {"b": 1}
    new = out.scheduled_new_reqs[0]
    skipped = SlidingWindow(8, 4).num_skipped_blocks(40)  # keys 33 .. 40: blocks 8 and 9 (and 10, new)
    assert skipped == 8 and new.block_ids[:skipped] == [s.kv.null_block_id] * skipped
    assert s.kv.num_skipped_blocks("b") == skipped and len(held(s, "b")) == 3


def test_a_handed_over_request_holds_only_its_window():
    s = make_scheduler(num_blocks=16, block_size=4, sliding_window=6)
    r = make_request("a", prompt_len=30, max_tokens=3)
    r.output_token_ids.append(7)
    r.num_computed_tokens = 30  # computed elsewhere (a disaggregated prefill): admitted as a decode
    s.add_request(r)
    out, _ = step(s, FakeExecutor())
    s.check_invariants()
    new = out.scheduled_new_reqs[0]
    assert new.block_ids[:6] == [s.kv.null_block_id] * 6 and len(new.block_ids) == 8  # keys 25 .. 30 of 31
    assert s.kv.pool.num_free_blocks == 16 - 2


def test_kv_eviction_is_refused_beside_a_window():
    s = make_scheduler(sliding_window=8)
    s.add_request(make_request("a", prompt_len=16))
    step(s, FakeExecutor())
    with pytest.raises(AssertionError, match="sliding window"):
        s.kv.evict_blocks(s.requests["a"], [0])
