"""Run-time dispatch on CPU features: dtype "auto", the kernels' instruction-set level, the build cache and its
fallback, and the prepacked linear layers against F.linear."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import conveyor.kernels.cpu_features as cf
from conveyor.kernels.build import library_path
from conveyor.kernels.cpu_ops import build_and_load
from conveyor.layers.linear import (PackedLinear, linear_add, linear_gelu, onednn_available, pack_linear,
                                   padded_rows)
from conveyor.models.build import choose_dtype
from tests.helpers.checkpoints import save_tiny_llama

ZEN3 = frozenset("sse4_2 avx avx2 fma f16c bmi2".split())
ZEN5 = ZEN3 | frozenset("avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16".split())
SAPPHIRE = ZEN5 | frozenset("amx_tile amx_bf16 amx_int8".split())


@pytest.mark.parametrize("flags,level,bf16", [(ZEN3, "avx2", False), (ZEN5, "avx512bf16", True),
                                              (SAPPHIRE, "avx512bf16", True), (frozenset({"sse2"}), "none", False),
                                              (ZEN5 - {"avx512_bf16"}, "avx512", False)])
def test_levels_and_native_bf16_from_flags(flags, level, bf16):
    feats = cf.CpuFeatures(flags, "x86_64")
    assert feats.native_level == level and feats.native_bf16 is bf16
    assert cf.CpuFeatures(flags, "aarch64").native_level == "none"


@pytest.mark.parametrize("flags,want", [(ZEN3, torch.float32), (ZEN5, torch.bfloat16), (SAPPHIRE, torch.bfloat16)])
def test_auto_dtype_follows_native_bf16(monkeypatch, flags, want):
    monkeypatch.setattr(cf, "cpu_features", lambda: cf.CpuFeatures(flags, "x86_64"))
    dtype, why = choose_dtype("auto", "cpu")
    assert dtype == want and why.startswith(f"auto: {str(want).removeprefix('torch.')}")
    assert choose_dtype("float32", "cpu")[0] == torch.float32  # an explicit dtype is never overridden


def test_auto_dtype_on_this_machine():
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    native = bool({"avx512_bf16", "amx_bf16"} & flags)
    assert choose_dtype("auto", "cpu")[0] == (torch.bfloat16 if native else torch.float32)


def test_forced_level_never_exceeds_the_cpu(monkeypatch):
    monkeypatch.setattr(cf, "cpu_features", lambda: cf.CpuFeatures(ZEN3, "x86_64"))
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "avx512bf16")
    assert cf.kernel_level() == "avx2"  # a binary this CPU cannot run is never chosen
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "none")
    assert cf.kernel_level() == "none"
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="CONVEYOR_CPU_ISA"):
        cf.kernel_level()


def test_cache_key_names_level_and_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    a = library_path("k", "src", "avx2", ("-mavx2",), "/usr/bin/c++")
    assert a.startswith(str(tmp_path)) and "avx2" in os.path.basename(a)
    assert a != library_path("k", "src", "avx512", ("-mavx2",), "/usr/bin/c++")
    assert a != library_path("k", "src2", "avx2", ("-mavx2",), "/usr/bin/c++")
    assert a != library_path("k", "src", "avx2", ("-mavx2", "-O2"), "/usr/bin/c++")


def test_cache_key_covers_every_header_of_the_source_directory(tmp_path):
    """The key hashes the whole csrc directory: an edit to a header alone is a new library."""
    import shutil

    from conveyor.kernels.build import read_sources, sources_digest_text
    from conveyor.kernels.cpu_ops import SOURCE_DIR

    src = tmp_path / "csrc"
    shutil.copytree(SOURCE_DIR, src)
    sources = read_sources(str(src))
    assert {"cvk.h", "vec.h", "api.cpp", "attention.cpp"} <= set(sources)
    before = library_path("k", sources_digest_text(sources), "avx2", ("-mavx2",), "/usr/bin/c++")
    (src / "vec.h").write_text((src / "vec.h").read_text() + "\n// edited\n")
    after = library_path("k", sources_digest_text(read_sources(str(src))), "avx2", ("-mavx2",), "/usr/bin/c++")
    assert before != after


def test_failed_build_warns_with_the_compilers_message(tmp_path, monkeypatch):
    """A compiler that fails: a warning carrying its own message, None, and the engine takes the torch path."""
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'fatal error: immintrin.h: No such file' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="(?s)torch path instead.*immintrin.h: No such file"):
        assert build_and_load("avx2") is None
    monkeypatch.setenv("CXX", str(tmp_path / "missing-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++ / g++ / clang++ either
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert build_and_load("avx2") is None


SCRIPT = r"""
import json, sys, torch
from conveyor import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", num_kv_blocks=64, block_size=16, detokenize=False)
runner = llm.engine.executor
last_logits, sample = {}, runner.sample
def keep_logits(logits, step, masks=None):  # the logits each sampled token came from
    last_logits.update({r.req_id: logits[i].float().tolist() for i, r in enumerate(step.sampling)})
    return sample(logits, step, masks)
runner.sample = keep_logits
prompts = [{"prompt_token_ids": [5 + i % 50 for i in range(n)]} for n in (3, 40, 17)]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
print("RESULT " + json.dumps({"backend": runner.backend, "tokens": [o.outputs[0].token_ids for o in outs],
                              "logits": last_logits}))
"""


def run_at_level(model_dir, level):
    env = dict(os.environ, CONVEYOR_CPU_ISA=level)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir)], capture_output=True, text=True, env=env,
                         timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, out.stderr[-2000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.skipif(cf.cpu_features().native_level == "none", reason="no native kernels on this CPU")
def test_engine_same_tokens_at_every_level(tmp_path):
    """The whole engine (head_dim 64: the native attention path) at the torch path, AVX2 and this CPU's own
    level: the same greedy tokens, logits equal to float32 rounding."""
    model_dir = save_tiny_llama(tmp_path / "m", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    runs = {lvl: run_at_level(model_dir, lvl) for lvl in ("none", "avx2", cf.cpu_features().native_level)}
    assert runs["none"]["backend"] == "cpu-torch" and runs["avx2"]["backend"] == "cpu-native"
    for lvl, run in runs.items():
        assert run["tokens"] == runs["none"]["tokens"], lvl
        for rid, logits in run["logits"].items():
            torch.testing.assert_close(torch.tensor(logits), torch.tensor(runs["none"]["logits"][rid]),
                                       atol=1e-4, rtol=1e-4)


def test_padded_rows_is_bounded_and_tight():
    sizes = {padded_rows(m) for m in range(1, 4097)}
    assert len(sizes) <= 160
    for m in range(1, 4097):
        assert m <= padded_rows(m) <= m + max(m // 16, 0) + 1
    assert [padded_rows(m) for m in (1, 17, 32, 33, 101, 2047)] == [1, 17, 32, 34, 104, 2048]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows", [1, 7, 33, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    layer = pack_linear(w, b)
    assert layer.use_onednn == (dtype != torch.float64 and onednn_available())
    assert layer.weight.shape == w.shape and layer.weight.device.type == "meta"  # counted, not stored twice
    got = layer(x)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype != torch.bfloat16 else dict(atol=0.1, rtol=2e-2)
    assert got.shape == (rows, 96) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows", [7, 200, 208])  # 208 = padded_rows(200): oneDNN's fused epilogue; 200 pads, unfused
def test_fused_gelu_and_residual_add_match_the_unfused_ops(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    w1, b1 = torch.randn(160, 64, generator=gen).to(dtype), torch.randn(160, generator=gen).to(dtype)
    w2, b2 = torch.randn(64, 160, generator=gen).to(dtype), torch.randn(64, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    up, down = pack_linear(w1, b1), pack_linear(w2, b2)
    h = linear_gelu(up, x)
    y = linear_add(down, h, x)
    want_h = F.gelu(F.linear(x.double(), w1.double(), b1.double()))
    want_y = F.linear(h.double(), w2.double(), b2.double()) + x.double()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype != torch.bfloat16 else dict(atol=0.25, rtol=2e-2)
    assert h.dtype == y.dtype == dtype and y.shape == (rows, 64)
    torch.testing.assert_close(h.double(), want_h, **tol)
    torch.testing.assert_close(y.double(), want_y, **tol)


def test_packed_linear_torch_fallback_is_the_same_layer():
    w, x = torch.randn(32, 16), torch.randn(5, 16)
    fallback = PackedLinear(w, None, use_onednn=False)
    torch.testing.assert_close(fallback(x), F.linear(x, w))


_PIN_SCRIPT = """
import json, os, sys, threading
import torch
from conveyor.kernels.binding import plan_core_binding
from conveyor.kernels.cpu_ops import load_cpu_kernels
cpus = sorted(os.sched_getaffinity(0))
torch.set_num_threads(int(sys.argv[1]))
binding, said = plan_core_binding(load_cpu_kernels())
inside = []
def step():  # what a step sees, twice: the pool is pinned at the first, the thread re-pinned at the second
    for _ in range(2):
        with binding.pinned():
            inside.append(sorted(os.sched_getaffinity(0)))
if binding is not None:
    step()
late = []  # a thread started after the steps: it inherits the main thread's mask
t = threading.Thread(target=lambda: late.append(sorted(os.sched_getaffinity(0)))); t.start(); t.join()
other = []  # steps run from another thread: its own pool is pinned, its mask restored after
if binding is not None:
    t = threading.Thread(target=lambda: (step(), other.append(sorted(os.sched_getaffinity(0))))); t.start(); t.join()
print(json.dumps({"cpus": cpus, "said": said, "main": sorted(os.sched_getaffinity(0)), "inside": inside,
                  "late": late[0], "other": other}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
@pytest.mark.parametrize("threads", ["all", 1])
def test_threads_pinned_one_per_cpu_only_while_a_step_runs(threads):
    """In a child process (pinning is per process): as many threads as allowed CPUs -> inside a step the stepping
    thread (thread 0 of its pool) is pinned to the first CPU, and after it its mask is back, so threads started
    later are not confined to that CPU; fewer threads -> left alone."""
    cpus = sorted(os.sched_getaffinity(0))
    n = len(cpus) if threads == "all" else 1
    if n < 2 and threads == "all":
        pytest.skip("one CPU: nothing to pin")
    out = subprocess.run([sys.executable, "-c", _PIN_SCRIPT, str(n)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["main"] == cpus and got["late"] == cpus
    if threads == "all" and "no native kernels" not in got["said"]:
        assert got["said"] == f"{n} threads pinned one per CPU of {cpus} while a step runs"
        assert got["inside"] == [[cpus[0]]] * 4 and got["other"] == [cpus]
    else:
        assert got["said"].startswith("threads not pinned") and got["inside"] == []


_ENGINE_PIN_SCRIPT = """
import json, os, sys, threading
import torch
from conveyor import LLM, SamplingParams
cpus = sorted(os.sched_getaffinity(0))
torch.set_num_threads(len(cpus))
llm = LLM(sys.argv[1], dtype="float32", enable_prefix_caching=False, detokenize=False)
prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(9 + 5 * i)]} for i in range(6)]
params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
ids = lambda: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
main_ids = ids()
seen = {}
def from_thread():
    seen["mask"] = sorted(os.sched_getaffinity(0))
    seen["ids"] = ids()
t = threading.Thread(target=from_thread); t.start(); t.join()
print(json.dumps({"cpus": cpus, "main": sorted(os.sched_getaffinity(0)), "thread": seen["mask"],
                  "same": seen["ids"] == main_ids}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_an_engine_leaves_its_callers_cpu_mask_alone(tiny_llama_dir):
    """Building and running an LLM (in a child process: pinning is per process) leaves the calling thread's CPU
    mask as it was, so a thread started afterwards may use every CPU (it inherits the mask; a pinned-for-good
    caller confined it, and an LLM run from it, to one CPU) and gets the same tokens."""
    out = subprocess.run([sys.executable, "-c", _ENGINE_PIN_SCRIPT, str(tiny_llama_dir)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["main"] == got["cpus"] and got["thread"] == got["cpus"] and got["same"]
