"""benchmarks/decode_ceiling.py: bytes a batch-1 token reads, per engine's layout, counted from a real GGUF (the
packaged SmolLM2 Q4_1: Q4_1 layers, a tied Q8_0 embedding read whole as the lm_head), and the bandwidth probe
compiles and measures; chat_stream_paired.py refuses to run without a llama-server (the comparison is its point)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.models.sources import DEFAULT_MODEL, packaged_model_path

BENCH = Path(__file__).parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ceiling = _load("decode_ceiling")


def test_bytes_a_token_of_the_packaged_q4_1():
    b = ceiling.bytes_per_token(packaged_model_path(DEFAULT_MODEL), positions=100)
    vocab, hidden = 49152, 576
    embedding = vocab * hidden // 32 * 34  # Q8_0: 34 bytes a block of 32
    assert b["types"]["Q8_0"] == embedding
    # every layer weight once, the tied embedding whole (the lm_head) and one row (the lookup), the norms
    expected = b["types"]["Q4_1"] + embedding + embedding / vocab + b["types"]["F32"]
    assert b["llama_weights"] == pytest.approx(expected)
    assert b["conveyor_weights"] == pytest.approx(expected)  # Q4_1 and Q8_0 pack at the file's bytes
    kv = 2 * 30 * 3 * 64 * 100  # K and V, 30 layers, 3 KV heads of 64, 100 positions
    assert b["llama_kv"] == 2 * kv and b["conveyor_kv"] == 4 * kv


def test_bytes_a_value_are_the_packed_forms():
    """The table is what layers/quantized.py packs: each type's packed bytes over its values."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf import quants as gq

    from conveyor.layers.gguf_blocks import from_gguf

    n, k = 32, 512
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    for qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        packed = from_gguf(gq.quantize(w, GGMLQuantizationType[qtype]).reshape(-1), qtype, (n, k)).pack()
        assert ceiling.CONVEYOR_BYTES_PER_VALUE[qtype] == pytest.approx(packed.nbytes / (n * k)), qtype
    assert ceiling.CONVEYOR_BYTES_PER_VALUE["Q5_0"] == pytest.approx((16 + 4 + 2) / 32)  # the file's 5.5 bits


def test_bandwidth_probe_measures():
    assert ceiling.read_bandwidth_gb_s(16, 1) > 0.1


def test_chat_stream_needs_a_llama_server_binary():
    done = subprocess.run([sys.executable, str(BENCH / "chat_stream_paired.py"), "--gguf", "m.gguf"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--llama-server" in done.stderr
