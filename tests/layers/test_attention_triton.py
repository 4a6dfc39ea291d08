"""The "triton" backend's kernels, run on the CPU under Triton's interpreter, equal the reference backend: mixed steps
of decodes and ragged prompt chunks, head sizes 64 and 128, GQA groups (including one that is not a power of two),
block sizes, sliding windows over a table with holes, bfloat16; the KV write skips padded rows; ``auto`` never picks
it on a CPU. Shapes stay tiny: the interpreter runs each program in numpy."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Triton defines its own library kernels (tl.max, tl.sum, tl.cdiv) when first imported: its interpreter must be on
# then, or an interpreted kernel cannot call them. Only for the import: the fixture below turns it on per test.
_interpret_before = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
finally:
    if _interpret_before is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _interpret_before

from conveyor.layers.attention import make_attention, resolve_backend  # noqa: E402
from tests.helpers.paged_steps import make_step  # noqa: E402


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Triton's interpreter on for each of these tests: the kernels module (imported by the backend's first step)
    defines its kernels as interpreted ones, and the backend and its launches see it on."""
    if type(triton.language.standard.cdiv).__name__ != "InterpretedFunction":
        pytest.fail("Triton was imported without TRITON_INTERPRET=1 before this module: its kernels cannot run here")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def run(backend, meta, q, k, v, cache, window=0, scale=0.125):
    written = cache.clone()
    out = make_attention(backend, meta, q.dtype).forward(q, k, v, written, scale, window=window)
    return out, written


def assert_same_written(a, b):
    """Both caches hold the same K/V, and the same NaNs where nothing was written."""
    torch.testing.assert_close(a, b, equal_nan=True, atol=0, rtol=0)


MIXED = [(40, 1), (3, 1), (17, 1), (0, 20), (17, 5), (33, 9)]  # decodes, a fresh prompt, chunks after context


@pytest.mark.parametrize("head_dim,heads,kv_heads,block_size", [
    (64, 4, 2, 16),  # the engine's block size, GQA group 2
    (128, 4, 1, 16),  # head size 128, group 4
    (64, 6, 2, 8),  # a group of 3: rows of a program padded past the group
    (64, 2, 2, 32),  # no GQA, blocks larger than the key tile
    (64, 4, 2, 1),  # one token per block: every key through its own table entry
])
def test_mixed_step_matches_reference(head_dim, heads, kv_heads, block_size):
    meta, q, k, v, cache = make_step(MIXED, block_size, heads, kv_heads, head_dim)
    want, want_cache = run("reference", meta, q, k, v, cache)
    got, got_cache = run("triton", meta, q, k, v, cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert_same_written(got_cache, want_cache)


def test_decode_only_step_matches_reference():
    """One query per program (the decode-only launch shape), contexts across block and tile edges."""
    reqs = [(c, 1) for c in (0, 1, 15, 16, 31, 32, 33, 70)]
    meta, q, k, v, cache = make_step(reqs, 16, 8, 2, 64)
    want, _ = run("reference", meta, q, k, v, cache)
    got, _ = run("triton", meta, q, k, v, cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def window_oracle(q, cache, meta, scale, window):
    """Each query over exactly its last ``window`` keys, read slot by slot from the written cache."""
    out = torch.empty_like(q)
    group = q.shape[1] // cache.shape[3]
    for i in range(meta.num_reqs):
        for row in range(meta.query_start_loc[i], meta.query_start_loc[i + 1]):
            slot = meta.num_computed[i] + row - meta.query_start_loc[i]
            keys = torch.arange(max(0, slot - window + 1), slot + 1)
            where = meta.block_table[i, keys // meta.block_size] * meta.block_size + keys % meta.block_size
            ks = cache[0].flatten(0, 1)[where].repeat_interleave(group, dim=1).float()  # [n, H, d]
            vs = cache[1].flatten(0, 1)[where].repeat_interleave(group, dim=1).float()
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[row].float(), ks) * scale, dim=-1)
            out[row] = torch.einsum("hn,nhd->hd", p, vs).to(q.dtype)
    return out


@pytest.mark.parametrize("window", [5, 24])
def test_sliding_window_never_reads_the_blocks_given_back(window):
    """Requests whose first blocks went back to the null block (NaN here): no NaN reaches the output."""
    reqs = [(60, 1), (45, 1), (50, 12)]
    meta, q, k, v, cache = make_step(reqs, 8, 4, 2, 64, null_blocks={0: 4, 1: 2, 2: 3})
    got, written = run("triton", meta, q, k, v, cache, window=window)
    assert not got.isnan().any()
    torch.testing.assert_close(got, window_oracle(q, written, meta, 0.125, window), atol=1e-5, rtol=1e-5)


def test_bfloat16_matches_reference():
    meta, q, k, v, cache = make_step(MIXED, 16, 4, 2, 128, dtype=torch.bfloat16)
    want, want_cache = run("reference", meta, q, k, v, cache)
    got, got_cache = run("triton", meta, q, k, v, cache)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert_same_written(got_cache, want_cache)


def test_under_the_padded_and_key_mass_wrappers_as_the_reference():
    """A static batch's pad rows (PaddedAttention) and KV eviction's scores (KeyMassAttention) wrap the triton
    backend as they wrap the reference: same outputs, same written cache, same attention mass per block, with the
    unwritten slots NaN (the key-mass pass reads whole blocks: it must mask them, as the GPU's unzeroed cache needs)."""
    from conveyor.layers.attention import Padding

    meta, q, k, v, cache = make_step(MIXED, 8, 4, 2, 64, seed=2)
    pad = 5
    gen = torch.Generator().manual_seed(9)
    qp, kp, vp = (torch.cat([x, torch.randn(pad, *x.shape[1:], generator=gen)]) for x in (q, k, v))
    results = {}
    for backend in ("reference", "triton"):
        padded, padded_cache = cache.clone(), cache.clone()
        out_padded = make_attention(backend, meta, torch.float32, Padding(pad, pad)).forward(qp, kp, vp, padded, 0.125)
        scored = make_attention(backend, meta, torch.float32, scored={0: 1, 3: 20, 5: 4})
        out_scored = scored.forward(q, k, v, padded_cache, 0.125)
        results[backend] = out_padded, padded, out_scored, padded_cache, scored.block_scores()
    for want, got in zip(results["reference"][:4], results["triton"][:4]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, equal_nan=True)  # the caches keep their NaNs
    assert not results["triton"][0].isnan().any() and not results["triton"][2].isnan().any()
    want_mass, got_mass = results["reference"][4], results["triton"][4]
    assert set(got_mass) == {0, 3, 5}
    for i in got_mass:
        torch.testing.assert_close(torch.tensor(got_mass[i]), torch.tensor(want_mass[i]))
        assert torch.tensor(got_mass[i]).isfinite().all()


def test_kv_write_skips_negative_slots():
    """A captured decode batch's padded rows carry slot -1: they store nothing; the real rows land as torch puts
    them."""
    from conveyor.kernels.triton_attention import write_kv

    meta, _, k, v, cache = make_step([(3, 4), (0, 2)], 4, 2, 2, 64)
    slots = meta.slot_mapping.clone()
    slots[[1, 4]] = -1
    kept = slots >= 0
    want = cache.clone()
    flat = want.view(2, -1, 2, 64)  # [K/V, slot, KV heads, head_dim]
    flat[0, slots[kept]], flat[1, slots[kept]] = k[kept], v[kept]
    got = cache.clone()
    write_kv(got, k, v, slots)
    assert_same_written(got, want)
    assert got.isnan().sum() == cache.isnan().sum() - 2 * int(kept.sum()) * 2 * 64  # only the kept rows landed


def test_a_padded_decode_graph_batch_computes_the_step_and_nothing_else():
    """The static buffers of a captured decode graph (runner.decode_graph_inputs), filled by two steps in turn and
    padded to the captured size: the step's rows equal the unpadded step's, padding rows are zero and write no KV,
    and nothing of the first fill leaks into the second."""
    from conveyor.runner.decode_graph_inputs import DecodeGraphInputs

    buffers = DecodeGraphInputs(max_size=16, max_blocks=8, block_size=8, device="cpu")
    for seed, contexts, size in ((0, (3, 9, 17, 30, 40, 55), 8), (1, (20, 2, 7), 4)):
        meta, q, k, v, cache = make_step([(c, 1) for c in contexts], 8, 4, 2, 64, seed=seed)
        want, want_cache = run("triton", meta, q, k, v, cache)
        n = meta.num_reqs
        ids = torch.arange(n)
        buffers.fill(size, ids, ids, meta)
        pad = torch.randn(size - n, *q.shape[1:]), torch.randn(size - n, *k.shape[1:])
        qp, kp, vp = torch.cat([q, pad[0]]), torch.cat([k, pad[1]]), torch.cat([v, pad[1]])
        got, got_cache = run("triton", buffers.metadata(size), qp, kp, vp, cache)
        torch.testing.assert_close(got[:n], want, atol=0, rtol=0)
        assert not got[n:].any()
        assert_same_written(got_cache, want_cache)
        assert buffers.slot_mapping[n:size].eq(-1).all() and not buffers.seq_lens[n:size].any()
    buffers.pad_all(8)  # what a graph is captured over: computes zeros, writes nothing
    got, got_cache = run("triton", buffers.metadata(8), qp[:8].repeat(2, 1, 1)[:8], kp[:8].repeat(2, 1, 1)[:8],
                         vp[:8].repeat(2, 1, 1)[:8], cache)
    assert not got.any()
    assert_same_written(got_cache, cache)
    meta, q, *_ = make_step([(3, 1), (0, 4)], 8, 4, 2, 64)
    with pytest.raises(ValueError, match="one token per request"):
        buffers.fill(8, torch.arange(5), torch.arange(5), meta)


def test_resolution(monkeypatch):
    """``auto`` on a CPU never resolves to triton; naming it on a CPU needs the interpreter; a dtype the kernel does
    not take is refused by name."""
    assert resolve_backend("auto", "cpu", torch.float32, 64, 16) != "triton"
    assert resolve_backend("cuda", "cpu", torch.float32, 64, 16) == "cpu-torch"
    assert resolve_backend("triton", "cpu", torch.float32, 64, 16) == "triton"  # interpreted
    with pytest.raises(ValueError, match="'triton' cannot serve torch.float64"):
        resolve_backend("triton", "cpu", torch.float64, 64, 16)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_backend("triton", "cpu", torch.float32, 64, 16)


def test_the_kernels_compile_for_an_h100(tmp_path):
    """What the interpreter cannot check: Triton's compiler takes the kernels down to an sm_90 cubin (no GPU needed;
    a process of its own, where the kernels are not interpreted)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.helpers.triton_compile"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok sm_90 attention") == 6 and done.stdout.count("ok sm_90 write_kv") == 2, done.stdout


@pytest.mark.slow  # a tiny model through the engine
def test_engine_greedy_tokens_equal_the_reference_backend(tmp_path):
    """The backend through the real runner (prefix caching, chunked prompts, decodes): token-identical to the
    reference backend, with equal logprobs."""
    from conveyor import LLM, SamplingParams
    from tests.helpers.checkpoints import save_tiny_llama

    path = save_tiny_llama(tmp_path / "m", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 90 for j in range(n)]} for i, n in enumerate((9, 23, 17))]
    prompts.append({"prompt_token_ids": prompts[1]["prompt_token_ids"] + [11, 12]})  # a prefix-cache hit
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    outs = {}
    for backend in ("reference", "triton"):
        llm = LLM(str(path), dtype="float32", attention_backend=backend, enable_prefix_caching=True,
                  max_num_batched_tokens=16, long_prefill_token_threshold=8, detokenize=False)
        assert llm.engine.executor.backend == backend
        outs[backend] = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
                         for o in llm.generate(prompts, params, use_tqdm=False)]
    for (ref_ids, ref_lps), (ids, lps) in zip(outs["reference"], outs["triton"]):
        assert ids == ref_ids
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


@pytest.mark.slow  # a tiny model through the engine
def test_decode_steps_through_the_graph_buffers_are_token_identical(tmp_path):
    """The runner's decode-graph path (runner.decode_graphs) without the capture itself (no GPU): decode-only steps
    run over the static buffers padded to a captured size, the prefill eagerly; tokens and logprobs as the reference
    backend's. Where it cannot run, it is refused."""
    from conveyor import LLM, SamplingParams
    from tests.helpers.checkpoints import save_tiny_llama

    path = save_tiny_llama(tmp_path / "m", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    # five prompts prefilled in one step, then decode-only steps of 5 (a graph of 8), 4, 3 (of 4), 2, 1 requests
    prompts = [{"prompt_token_ids": [5 + (i * 11 + j) % 90 for j in range(n)]} for i, n in enumerate((9, 3, 4, 7, 6))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0) for m in (7, 3, 5, 6, 2)]
    outs = {}
    for backend in ("reference", "triton"):
        llm = LLM(str(path), dtype="float32", attention_backend=backend, max_num_seqs=8, max_num_batched_tokens=32,
                  detokenize=False)
        if backend == "triton":
            runner = llm.engine.executor
            with pytest.raises(ValueError, match="CUDA device"):
                runner.attach_decode_graphs(8)  # capturing needs a GPU
            runner.attach_decode_graphs(8, capture=False)
            assert runner.decode_graphs.plan.sizes == (1, 2, 4, 8)
        outs[backend] = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
                         for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runner.decode_graphs.num_replays == 6  # every decode-only step went through the buffers
    for (ref_ids, ref_lps), (ids, lps) in zip(outs["reference"], outs["triton"]):
        assert ids == ref_ids
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
    with pytest.raises(ValueError, match="triton attention backend"):
        LLM(str(path), dtype="float32", attention_backend="reference", cuda_graphs=True)
