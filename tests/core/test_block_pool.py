"""Block pool and KV manager: unit scenarios and hypothesis property tests."""

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core import Request, SamplingParams
from conveyor.core.block_pool import BlockPool, hash_block
from conveyor.core.kv_manager import KVCacheManager


def _req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def test_allocate_checks_and_commits_together():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = _req("a", range(20))
    assert kv.allocate_slots(r, 20) is None  # needs 5 blocks
    assert kv.pool.num_free_blocks == 4 and not kv.block_ids("a")  # nothing committed
    assert kv.allocate_slots(r, 16) == [0, 1, 2, 3]
    kv.check_invariants()


def test_block_hash_is_set_once():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    b.block_hash = 1
    try:
        b.block_hash = 2
    except AssertionError:
        pass
    else:
        raise AssertionError("second hash assignment was accepted")


def test_freed_tail_blocks_are_evicted_first():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    r = _req("a", range(6))
    kv.allocate_slots(r, 6)
    kv.free(r)
    order = [b.block_id for b in kv.pool.free_list]
    assert order == [2, 1, 0]  # the chain's tail first
    # the prefix block survives the longest: a new request with the same prefix still hits it
    kv.allocate_slots(_req("b", range(100, 102)), 2)
    hits, n = kv.get_computed_blocks(_req("c", list(range(4)) + [99]))
    assert n == 4 and [b.block_id for b in hits] == [0, 1]


def test_a_free_unhashed_block_is_handed_out_before_a_cached_one_is_evicted():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    a, x = _req("a", [1, 2]), _req("x", [7])  # a fills (and caches) a block; x's block stays partial
    kv.allocate_slots(a, 2)
    kv.allocate_slots(x, 1)
    kv.free(a)
    kv.free(x)  # freed after a's cached block, yet it goes first: it holds nothing to reuse
    assert kv.allocate_slots(_req("b", [5]), 1) is not None
    hits, n = kv.get_computed_blocks(_req("c", [1, 2, 3]))
    assert n == 2 and kv.pool.num_evictions == 0
    kv.check_invariants()


def test_hit_on_free_cached_block_counts_against_room():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    a = _req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    kv.free(a)
    b = _req("b", [1, 2, 9, 9, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 2
    assert kv.allocate_slots(b, 3, hits) is None  # 1 hit block (free) + 2 new > 2 free blocks
    kv.check_invariants()


def test_chained_hash_depends_on_parent():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0, 0]), [1, 2])


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "grow", "free", "hit"]), st.integers(0, 7), st.integers(1, 9)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 16),
       window=st.sampled_from([0, 0, 1, 3, 8]))
def test_kv_manager_invariants_hold_under_any_operation_sequence(ops, block_size, num_blocks, window):
    kv = KVCacheManager(num_blocks, block_size, sliding_window=window)
    live: dict[str, Request] = {}
    for op, slot, n in ops:
        rid = f"r{slot}"
        first = None  # the position of the first token an allocation made room for
        if op in ("alloc", "hit") and rid not in live:
            prefix = [7] * (n if op == "hit" else 0)
            r = _req(rid, prefix + [slot * 10 + i for i in range(n)])
            hits, hit_tokens = kv.get_computed_blocks(r)
            assert hit_tokens < r.num_tokens
            if kv.allocate_slots(r, r.num_tokens - hit_tokens, hits) is not None:
                r.num_computed_tokens = r.num_tokens
                live[rid], first = r, hit_tokens
        elif op == "grow" and rid in live:
            r = live[rid]
            before = len(kv.block_ids(rid))
            r.output_token_ids.extend([1] * n)
            new = kv.allocate_slots(r, n)
            if new is not None:
                first = r.num_computed_tokens
                r.num_computed_tokens = r.num_tokens
                assert len(kv.block_ids(rid)) == before + len(new)
            else:
                del r.output_token_ids[-n:]
        elif op == "free" and rid in live:
            kv.free(live.pop(rid))
        kv.check_invariants()
        for r in live.values():
            assert len(kv.block_ids(r.request_id)) * block_size >= r.num_computed_tokens
        if first is not None and window:  # exactly the blocks before the first new token's window went back
            assert kv.num_skipped_blocks(rid) == kv.window.num_skipped_blocks(first)
    for r in list(live.values()):
        kv.free(r)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == num_blocks
