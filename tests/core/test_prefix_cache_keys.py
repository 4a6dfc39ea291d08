"""Prefix-cache block keys: a collision must never hand one request another request's KV.

A hit is trusted without comparing tokens (see ``BlockPool.lookup``), so the property the cache rests on is:
two blocks get the same key only if they have the same parent key and the same token ids. The key is SHA-256
over an injective byte encoding; these tests pin both halves: (1) pairs that collided under the old key
(Python's 64-bit ``hash()``) are kept apart, through the KV manager and the scheduler; (2) the encoding is
injective, so the only way left to collide is a SHA-256 collision; (3) the digest is SHA-256 of exactly that
encoding, and inputs the encoding cannot represent raise instead of aliasing.
"""

import struct
from hashlib import sha256
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core import Request, SamplingParams
from conveyor.core import block_pool
from conveyor.core.block_pool import ROOT_KEY, hash_block
from conveyor.core.kv_manager import KVCacheManager
from tests.helpers.core import FakeExecutor, make_scheduler, step

BS = 16
# CPython hashes an int modulo the Mersenne prime 2**61 - 1, and a tuple from its items' hashes, so these two
# different blocks had the same old key, (None, block) -> hash(...), with no search at all. Real token ids are
# smaller, but a 64-bit non-cryptographic key is open to collisions, accidental (1 in 2**64 per pair of
# blocks) or crafted (tuple hashing is invertible).
BLOCK_A = [0] * BS
BLOCK_B = [2**61 - 1] + [0] * (BS - 1)


def _req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def test_the_two_blocks_collided_under_the_old_key():
    assert BLOCK_A != BLOCK_B
    assert hash((None, tuple(BLOCK_A))) == hash((None, tuple(BLOCK_B)))  # the old hash_block's key
    assert hash_block(None, BLOCK_A) != hash_block(None, BLOCK_B)


def test_a_block_colliding_under_the_old_key_gets_nothing_of_the_cached_one():
    """Request a caches three blocks; b differs only in its first token, in a way that collided under the old
    key (and so did every block after it, the chain being built from the colliding parent). b must get no
    cache hit and none of a's blocks, and the pool must stay consistent."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    tail = list(range(100, 100 + 2 * BS)) + [7]
    a, b = _req("a", BLOCK_A + tail), _req("b", BLOCK_B + tail)
    assert kv.allocate_slots(a, a.num_tokens) is not None
    a.num_computed_tokens = a.num_tokens
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert num_hit_tokens == 0 and hits == []  # the old key served 3 * BS tokens of a's KV here
    assert kv.allocate_slots(b, b.num_tokens, hits) is not None
    assert not set(kv.block_ids("a")) & set(kv.block_ids("b"))
    kv.check_invariants()
    # the same prompt as a still hits every full block but the last token's: the keys still name what they should
    again, n = kv.get_computed_blocks(_req("a2", BLOCK_A + tail))
    assert n == 3 * BS and [blk.block_id for blk in again] == kv.block_ids("a")[:3]


def test_the_scheduler_computes_a_colliding_prompt_from_scratch():
    """The same through the scheduler: b's prompt is scheduled whole, with no tokens from the cache."""
    s = make_scheduler(num_blocks=32, block_size=BS, max_num_batched_tokens=256)
    ex = FakeExecutor()
    tail = list(range(100, 100 + BS)) + [7]
    s.add_request(_req("a", BLOCK_A + tail))
    step(s, ex)
    s.add_request(_req("b", BLOCK_B + tail))
    out, _ = step(s, ex)
    new = {r.request_id: r for r in out.scheduled_new_reqs}
    assert new["b"].num_computed_tokens == 0 and out.num_scheduled_tokens["b"] == 2 * BS + 1
    assert s.kv.prefix_hits == 0
    s.check_invariants()


KEYS = [None, ROOT_KEY, sha256(b"k1").digest(), sha256(b"k2").digest()]
token_ids = st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 300), max_size=40)


@settings(max_examples=300, deadline=None)
@given(p1=st.sampled_from(KEYS), t1=token_ids, p2=st.sampled_from(KEYS), t2=token_ids)
def test_the_encoding_is_injective(p1, t1, p2, t2):
    """With the digest replaced by the identity, a key *is* the encoded bytes: two different (parent, tokens)
    pairs must never encode alike (None stands for ROOT_KEY, by design). Lengths differ in 8-byte steps and the
    parent is always the first 32 bytes, so no shift of a boundary can make two encodings meet."""
    same = ((p1 or ROOT_KEY), t1) == ((p2 or ROOT_KEY), t2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(block_pool, "sha256", lambda data: SimpleNamespace(digest=lambda: data))
        assert (hash_block(p1, t1) == hash_block(p2, t2)) == same


def test_the_key_is_sha256_of_the_documented_encoding():
    assert ROOT_KEY == sha256(b"conveyor prefix-cache block key v1").digest()
    key = hash_block(None, [1, 2, 3])
    assert key == sha256(ROOT_KEY + struct.pack("<3q", 1, 2, 3)).digest() and len(key) == 32
    assert hash_block(key, [4]) == sha256(key + (4).to_bytes(8, "little")).digest()


def test_what_the_encoding_cannot_represent_raises_instead_of_aliasing():
    with pytest.raises(struct.error):
        hash_block(None, [2**63])  # would wrap to -2**63 if packed modulo 2**64
    with pytest.raises(ValueError):
        hash_block(b"short", [1])  # a parent of another length would shift the token boundary
    with pytest.raises(ValueError):
        hash_block(ROOT_KEY + b"\0", [1])
