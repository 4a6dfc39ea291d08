"""The prefix cache's eviction policies: ``lru`` unchanged by default, ``cost`` (GDSF over block chains) keeping
the pool's invariants, evicting cheap cold blocks and chain leaves first; the saved-token counter."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core import Request, RequestStatus, SamplingParams
from conveyor.core.block_pool import BlockPool, FreeBlockList
from conveyor.core.config import CacheConfig
from conveyor.core.kv_manager import KVCacheManager
from conveyor.core.prefix_eviction import CostAwareFreeBlocks
from tests.helpers.core import FakeExecutor, make_scheduler, step


def _req(rid, tokens, **params):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4, **params))


def _run(kv, rid, tokens, **params):
    """Admit a request (taking its prefix hit) and free it again; returns its hit tokens."""
    r = _req(rid, tokens, **params)
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    kv.free(r)
    kv.check_invariants()
    return n


def _hit(kv, tokens):
    return kv.get_computed_blocks(_req("probe", tokens))[1]


def test_lru_is_the_default_and_keeps_the_plain_free_list():
    assert CacheConfig().prefix_cache_eviction == "lru"
    assert type(KVCacheManager(4, 2).pool.free_list) is FreeBlockList
    assert type(BlockPool(4, "cost").free_list) is CostAwareFreeBlocks
    with pytest.raises(ValueError, match="prefix_cache_eviction"):
        BlockPool(4, "lfu")
    with pytest.raises(ValueError, match="prefix_cache_eviction"):
        CacheConfig(prefix_cache_eviction="lfu")


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_cost_evicts_the_cheap_cold_block_before_the_expensive_hot_one(policy):
    # 4 blocks of 2 tokens. H: a 2-block chain hit twice (hot, deep). C: one block never hit (cold, shallow),
    # freed last, so LRU thinks it the most valuable.
    kv = KVCacheManager(4, 2, prefix_cache_eviction=policy)
    hot = [1, 2, 3, 4]
    assert _run(kv, "h1", hot + [5]) == 0
    assert _run(kv, "h2", hot + [9]) == 4
    assert _run(kv, "h3", hot + [8]) == 4
    assert _run(kv, "c", [7, 8, 6]) == 0
    # one more request needs 2 blocks: the unhashed one, and one evicted
    _run(kv, "x", [20, 21, 22])
    assert kv.pool.num_evictions == 1
    if policy == "cost":
        assert (_hit(kv, hot + [0]), _hit(kv, [7, 8, 0])) == (4, 0)  # the hot chain whole, the cold block gone
    else:
        assert (_hit(kv, hot + [0]), _hit(kv, [7, 8, 0])) == (2, 2)  # LRU cut the hot chain's tail instead


def test_cost_evicts_a_chain_from_its_leaf_even_when_the_leaf_scores_higher():
    # A 3-block chain hit once: scores grow with position (1, 2, 3 x hits), so by score alone the first block
    # would go first and strand the other two. Leaves first keeps the longest prefix reachable.
    kv = KVCacheManager(4, 2, prefix_cache_eviction="cost")
    chain = [1, 2, 3, 4, 5, 6]
    _run(kv, "a", chain + [7])
    assert _run(kv, "b", chain + [8]) == 6
    _run(kv, "x", [30, 31, 32])  # 2 blocks: the unhashed one + 1 eviction
    assert _hit(kv, chain + [0]) == 4
    _run(kv, "y", [40, 41, 42])
    assert _hit(kv, chain + [0]) == 2


def test_a_free_parent_with_a_cached_child_in_use_goes_after_every_free_leaf():
    # p caches k0 and is freed. q computes the same first block (prompt logprobs: no cache lookup), so its own
    # copy stays an unhashed duplicate while its second block is cached under the free holder of k0: that parent
    # must stop counting as a leaf while free (re-keyed), and a free leaf with a higher score goes before it.
    kv = KVCacheManager(5, 2, prefix_cache_eviction="cost")
    _run(kv, "p", [1, 2, 9])  # block of k0, hits 0
    _run(kv, "l1", [5, 6, 9])
    _run(kv, "l2", [5, 6, 8])  # [5, 6]: a leaf hit once, scores above p's block
    q = _req("q", [1, 2, 3, 4, 9], prompt_logprobs=0)
    assert kv.get_computed_blocks(q) == ([], 0)
    assert kv.allocate_slots(q, 5) is not None
    kv.check_invariants()
    parent = kv.pool.cached[q.block_hashes[0]]
    assert parent.ref_cnt == 0 and kv.pool.free_list.children[parent.block_id] == 1
    assert kv.pool.free_list.unhashed.num_free == 0  # free now: p's block (k0) and the [5, 6] leaf
    r = _req("r", [60, 61])  # one block: one eviction
    assert kv.allocate_slots(r, 2) is not None
    kv.check_invariants()
    assert _hit(kv, [5, 6, 0]) == 0 and _hit(kv, [1, 2, 0]) == 2  # the leaf went, the parent stayed
    s = _req("s", [70, 71])  # no free leaf left: the parent goes now, its child in use is stranded
    assert kv.allocate_slots(s, 2) is not None
    kv.check_invariants()
    assert _hit(kv, [1, 2, 3, 4, 0]) == 0
    for done in (q, r, s):
        kv.free(done)
    kv.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_reset_prefix_cache_keeps_invariants(policy):
    kv = KVCacheManager(6, 2, prefix_cache_eviction=policy)
    _run(kv, "a", [1, 2, 3, 4, 5])
    held = _req("b", [1, 2, 3, 4, 6])
    hits, n = kv.get_computed_blocks(held)
    kv.allocate_slots(held, held.num_tokens - n, hits)
    kv.reset_prefix_cache()
    kv.check_invariants()
    assert _hit(kv, [1, 2, 3, 4, 0]) == 0
    kv.free(held)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == 6


def test_saved_tokens_count_only_committed_hits():
    kv = KVCacheManager(2, 2)
    _run(kv, "a", [1, 2, 3])
    b = _req("b", [1, 2, 9, 9, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 2 and kv.allocate_slots(b, 3, hits) is None  # found, but no room: looked up, not saved
    assert (kv.prefix_hits, kv.prefix_saved_tokens) == (2, 0)
    assert _run(kv, "c", [1, 2, 7]) == 2
    assert (kv.prefix_hits, kv.prefix_saved_tokens) == (4, 2)


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "grow", "free", "hit", "nocache", "reset"]), st.integers(0, 7),
              st.integers(1, 9)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 16),
       policy=st.sampled_from(["lru", "cost"]))
def test_invariants_hold_under_any_operation_sequence_with_either_policy(ops, block_size, num_blocks, policy):
    """test_block_pool's property test, with both policies, cache resets, and requests that skip the lookup
    (prompt logprobs) so that duplicates of cached blocks, and cached children of free parents, occur."""
    kv = KVCacheManager(num_blocks, block_size, prefix_cache_eviction=policy)
    live: dict[str, Request] = {}
    for op, slot, n in ops:
        rid = f"r{slot}"
        if op in ("alloc", "hit", "nocache") and rid not in live:
            prefix = [7] * (n if op != "alloc" else 0)
            params = {"prompt_logprobs": 0} if op == "nocache" else {}
            r = _req(rid, prefix + [slot * 10 + i for i in range(n)], **params)
            hits, hit_tokens = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - hit_tokens, hits) is not None:
                r.num_computed_tokens = r.num_tokens
                live[rid] = r
        elif op == "grow" and rid in live:
            r = live[rid]
            r.output_token_ids.extend([1] * n)
            if kv.allocate_slots(r, n) is not None:
                r.num_computed_tokens = r.num_tokens
            else:
                del r.output_token_ids[-n:]
        elif op == "free" and rid in live:
            kv.free(live.pop(rid))
        elif op == "reset":
            kv.reset_prefix_cache()
        kv.check_invariants()
    for r in list(live.values()):
        kv.free(r)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == num_blocks


@pytest.mark.parametrize("policy", ["lru", "cost"])
@pytest.mark.parametrize("seed", range(6))
def test_random_scheduler_drive_keeps_invariants_and_counts_what_it_saved(policy, seed):
    """test_scheduler's random drive under cache pressure, with either policy: invariants after every step, all
    blocks back at the end, and the saved-token counter equal to the hits the scheduler admitted with."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    s = make_scheduler(num_blocks=rng.randint(60, 120) // block_size + 8, block_size=block_size,
                       max_num_seqs=rng.randint(1, 12), max_num_batched_tokens=rng.choice([8, 32, 128]),
                       max_model_len=200, prefix_cache_eviction=policy)
    ex = FakeExecutor(rng)
    shared = [[rng.randrange(5, 50) for _ in range(32)] for _ in range(3)]
    reqs = [Request(f"r{i}", rng.choice(shared)[: rng.randint(0, 32)] + [rng.randrange(5, 50) for _ in
                    range(rng.randint(1, 30))], SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True),
                    (2,), 200) for i in range(rng.randint(10, 30))]
    pending = list(reqs)
    seen_hits = 0
    for t in range(5000):
        if pending and rng.random() < 0.3:
            s.add_request(pending.pop(0))
        if rng.random() < 0.02 and s.running:
            s.finish_request(rng.choice(s.running).request_id, RequestStatus.FINISHED_ABORTED, t)
        out, _ = step(s, ex, float(t))
        seen_hits += sum(n.num_computed_tokens for n in out.scheduled_new_reqs)
        s.check_invariants()
        if not pending and not s.has_unfinished_requests():
            break
    assert not pending and not s.has_unfinished_requests()
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks
    assert s.kv.prefix_saved_tokens == seen_hits
    if not s.num_preemptions:
        assert seen_hits == sum(r.num_cached_prompt_tokens for r in reqs)
