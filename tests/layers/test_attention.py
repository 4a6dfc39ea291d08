"""The fast attention backends equal the reference on mixed batches, across block sizes; backends declare their
layout and fusions and nothing outside the package asks by name; pad rows compute but change nothing."""

from __future__ import annotations

import random

import pytest
import torch

from conveyor.core.config import ATTENTION_BACKENDS
from conveyor.layers.attention import (AttentionMetadata, Padding, allocate_kv_caches, backend_class, make_attention,
                                       resolve_backend)
from conveyor.layers.attention.common import causal_self_attention
from conveyor.layers.attention.padded import PaddedAttention

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16


def make_step(block_size, reqs, num_blocks=256, pad=0, seed=0):
    """reqs: list of (num_computed, num_new). Decodes (num_new == 1) first, sorted by context, as the runner does.

    Returns metadata, the padding (``pad`` rows in one segment; None without), random q/k/v for the new tokens
    and the pad rows, and a cache whose already-computed slots hold random K/V.
    """
    gen = torch.Generator().manual_seed(seed)
    reqs = sorted([r for r in reqs if r[1] == 1]) + [r for r in reqs if r[1] != 1]
    num_blocks = max(num_blocks, sum(-(-(c + n) // block_size) for c, n in reqs) + 8)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    cache = torch.randn(2, num_blocks, block_size, KV_HEADS, HEAD_DIM, generator=gen)
    tables, slots, qsl = [], [], [0]
    for computed, new in reqs:
        nblk = -(-(computed + new) // block_size)
        table = [free.pop() for _ in range(nblk)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(computed, computed + new)]
        qsl.append(qsl[-1] + new)
    width = max((len(t) for t in tables), default=0)
    meta = AttentionMetadata(
        num_tokens=qsl[-1], block_size=block_size, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=qsl, seq_lens=[c + n for c, n in reqs], num_computed=[c for c, _ in reqs],
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64).view(len(reqs), width),
        num_decodes=sum(1 for _, n in reqs if n == 1))
    total = qsl[-1] + pad
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
    return meta, Padding(pad, pad) if pad else None, q, k, v, cache


MIXES = {
    "decodes_of_many_lengths": [(c, 1) for c in (0, 1, 5, 15, 16, 17, 31, 32, 33, 64, 100, 300, 301)],
    "prefills_fresh": [(0, 7), (0, 33), (0, 1)],
    "chunks_with_context": [(16, 16), (5, 9), (31, 2)],
    "mixed": [(40, 1), (3, 1), (0, 20), (17, 5), (100, 1), (64, 30), (0, 1)],
}


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("pad", [0, 5])
def test_cpu_backend_matches_reference(block_size, mix, pad):
    meta, padding, q, k, v, cache = make_step(block_size, MIXES[mix], pad=pad)
    ref_cache, fast_cache = cache.clone(), cache.clone()
    ref = make_attention("reference", meta, torch.float32, padding).forward(q, k, v, ref_cache, 0.25)
    fast = make_attention("cpu-torch", meta, torch.float32, padding).forward(q, k, v, fast_cache, 0.25)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_cache, ref_cache)


def window_oracle(q, cache, meta, scale, window):
    """Each query over exactly its last ``window`` keys (read from the written token-major cache), one by one."""
    out = torch.empty_like(q)
    group = q.shape[1] // cache.shape[3]
    for i, seq_len in enumerate(meta.seq_lens):
        for row in range(meta.query_start_loc[i], meta.query_start_loc[i + 1]):
            slot = meta.num_computed[i] + row - meta.query_start_loc[i]
            keys = torch.arange(max(0, slot - window + 1), slot + 1)
            where = meta.block_table[i, keys // meta.block_size] * meta.block_size + keys % meta.block_size
            ks = cache[0].flatten(0, 1)[where].repeat_interleave(group, dim=1)  # [n, H, d]
            vs = cache[1].flatten(0, 1)[where].repeat_interleave(group, dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[row], ks) * scale, dim=-1)
            out[row] = torch.einsum("hn,nhd->hd", p, vs)
    return out


@pytest.mark.parametrize("window", [1, 6, 40])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_sliding_window_in_every_torch_backend(mix, window):
    meta, _, q, k, v, cache = make_step(16, MIXES[mix])
    outs = {}
    for backend in ("reference", "cpu-torch"):
        written = cache.clone()
        outs[backend] = make_attention(backend, meta, torch.float32).forward(q, k, v, written, 0.25, window=window)
    want = window_oracle(q, written, meta, 0.25, window)
    for backend, out in outs.items():
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, msg=backend)


def test_writes_before_reads_and_pad_touches_nothing():
    """Request B's context block is written by request A in the same step (a same-step prefix hit)."""
    bs = 4
    meta, padding, q, k, v, cache = make_step(bs, [(0, 8)], pad=3)
    before = cache.clone()
    make_attention("cpu-torch", meta, torch.float32, padding).forward(q, k, v, cache, 0.25)
    changed = (cache != before).any(dim=(2, 3, 4)).any(dim=0).nonzero().flatten().tolist()
    assert sorted(changed) == sorted(meta.block_table[0].tolist())  # pad tokens wrote nothing
    # B shares A's first block (positions 0..3, computed) and adds 1 token: it must see A's fresh K/V.
    shared = meta.block_table[0, 0].item()
    table = torch.tensor([[meta.block_table[0, 0].item(), meta.block_table[0, 1].item()],
                          [shared, 200]], dtype=torch.int64)
    meta2 = AttentionMetadata(num_tokens=9, block_size=bs,
                              slot_mapping=torch.cat([torch.tensor([200 * bs]), meta.slot_mapping]),
                              query_start_loc=[0, 1, 9], seq_lens=[5, 8], num_computed=[4, 0],
                              block_table=table[[1, 0]], num_decodes=1)
    q2 = torch.cat([q[8:9], q[:8]])
    k2, v2 = torch.cat([k[8:9], k[:8]]), torch.cat([v[8:9], v[:8]])
    fresh = torch.zeros_like(cache)
    ref = make_attention("reference", meta2, torch.float32).forward(q2, k2, v2, fresh.clone(), 0.25)
    fast = make_attention("cpu-torch", meta2, torch.float32).forward(q2, k2, v2, fresh.clone(), 0.25)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    # The decode's keys 0..3 are A's keys 0..3 of this very step.
    expect = torch.nn.functional.scaled_dot_product_attention(
        q2[0].view(KV_HEADS, HEADS // KV_HEADS, 1, HEAD_DIM),
        torch.cat([k[:4], k[8:9]]).transpose(0, 1).unsqueeze(1), torch.cat([v[:4], v[8:9]]).transpose(0, 1).unsqueeze(1),
        scale=0.25)
    torch.testing.assert_close(fast[0], expect.reshape(HEADS, HEAD_DIM), atol=1e-5, rtol=1e-5)


def test_pad_rows_attend_within_segments_and_the_backend_never_sees_them():
    # Static batching pads each prompt to the batch's longest: pads cost like padded rows, so they must
    # attend within segments of at most that length, never as one sequence of all the padding.
    meta, _, q, k, v, cache = make_step(4, [(0, 6), (3, 1)], pad=10)
    seen = []

    class Recording:  # an attention backend that records what it is given
        name = "recording"

        def forward(self, q, k, v, kv_cache, scale, rope=None, window=0):
            seen.append(q.shape[0])
            return torch.zeros_like(q)

    out = PaddedAttention(Recording(), meta.num_tokens, Padding(10, 4)).forward(q, k, v, cache, 0.3)
    assert seen == [meta.num_tokens]  # only the real rows reach the backend
    assert out[:meta.num_tokens].abs().sum() == 0
    n = meta.num_tokens
    for s, e in ((n, n + 4), (n + 4, n + 8), (n + 8, n + 10)):
        torch.testing.assert_close(out[s:e], causal_self_attention(q[s:e], k[s:e], v[s:e], 0.3))


def test_backends_own_their_layout_and_names_are_unique():
    """Every resolved name is one class's; the runner's caches come out in that class's declared shape, zeroed
    only where the backend says its reads need it; "cpu" and "auto" resolve to a name that can run here."""
    from conveyor.core.config import ATTENTION_BACKENDS

    resolved = {resolve_backend(name, "cpu", torch.float32, HEAD_DIM, 16) for name in ("auto", "cpu", "cpu-torch",
                                                                                      "reference", "cuda")}
    assert resolved <= set(ATTENTION_BACKENDS) and "auto" not in resolved and "cpu" not in resolved
    assert resolve_backend("cuda", "cpu", torch.float32, HEAD_DIM, 16) == "cpu-torch"  # no flash-attn here
    for name in sorted(resolved | {"cpu-native"}):
        cls = backend_class(name)
        assert cls.name == name
        caches = allocate_kv_caches(name, 2, 3, 4, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
        assert len(caches) == 2 and all(c.shape == cls.kv_layout.shape(3, 4, KV_HEADS, HEAD_DIM) for c in caches)
        if cls.cache_needs_zeroing:
            assert all(not c.any() for c in caches)
    assert backend_class("cpu-native").kv_layout.shape(3, 4, 2, 8) == (2, 3, 2, 4, 8)  # head-major blocks
    with pytest.raises(ValueError, match="unknown attention backend"):
        backend_class("cpu")  # a choice, not a backend


def test_a_backend_that_does_not_fuse_rope_refuses_the_table():
    meta, _, q, k, v, cache = make_step(4, [(0, 3)])
    for name in ("reference", "cpu-torch"):
        assert not backend_class(name).fuses_rope
        with pytest.raises(ValueError, match="does not fuse RoPE"):
            make_attention(name, meta, torch.float32).forward(q, k, v, cache.clone(), 0.25,
                                                              rope=torch.zeros(3, HEAD_DIM))


def test_no_caller_outside_the_package_names_a_backend_class_or_tests_a_backend_by_name():
    """What a caller needs is declared on the backend (layout, fusion flags); nothing outside
    layers/attention/ imports a backend's module, compares a backend name, or probes attributes with getattr."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "conveyor"
    modules = {"cpu", "native_cpu", "reference", "cuda", "padded", "triton_paged"}
    classes = {"CpuAttention", "NativeCpuAttention", "ReferenceAttention", "FlashAttention", "PaddedAttention",
               "TritonAttention"}
    offences = []
    for path in root.rglob("*.py"):
        if path.parent.name == "attention" and path.parent.parent.name == "layers":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("conveyor.layers.attention"):
                if node.module.rsplit(".", 1)[-1] in modules or {a.name for a in node.names} & classes:
                    offences.append(f"{where} imports {node.module}")
            elif isinstance(node, ast.Name) and node.id in classes:
                offences.append(f"{where} names {node.id}")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) > 1 \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id == "attn":
                offences.append(f"{where} probes attn with getattr")
            elif isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in ATTENTION_BACKENDS for c in node.comparators) and \
                    "backend" in ast.unparse(node.left):
                offences.append(f"{where} compares a backend name: {ast.unparse(node)}")
    assert not offences, offences


@pytest.mark.slow  # the embedded 40M model
def test_padding_tokens_are_computed_but_change_nothing():
    from conveyor.bench.step_builder import StepBuilder
    from conveyor.models import EMBEDDED_NAME, load_model
    from tests.helpers.runner import LogitsRecordingRunner

    model, info = load_model(EMBEDDED_NAME)
    model.native_stack = None  # the hook below sees the per-layer path; the one-call stack (test_native_stack) skips it
    rows_seen = []
    hook = model.layers[-1].mlp.register_forward_hook(lambda mod, args, out: rows_seen.append(out.shape[0]))
    runs = []
    for pad in (0, 7):
        runner = LogitsRecordingRunner(model, info, num_blocks=32, block_size=16)
        for cache in runner.kv_caches:  # the native CPU backend starts with its cache unwritten: make it known
            cache.zero_()
        sched = StepBuilder(16, 32, shuffle_seed=0)
        sched.add("a", list(range(100, 120)))
        sched.run(runner, {"a": None}, num_padding_tokens=pad)
        sched.run(runner, {"a": 1}, num_padding_tokens=pad)
        runs.append((sched.tokens["a"], runner.last_logits["a"], [c.clone() for c in runner.kv_caches]))
    hook.remove()
    assert rows_seen == [20, 1, 27, 8]  # the pad rows really went through the whole stack
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1])
    for c0, c1 in zip(runs[0][2], runs[1][2]):
        torch.testing.assert_close(c0, c1)  # pad tokens wrote nothing anywhere
