"""benchmarks/side_by_side.py's decode bytes floor: the bytes it counts for a model and a workload (the read rate
is measured, so only the counts and how they combine are checked)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

from conveyor.sim.model_specs import ModelSpec

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "side_by_side.py"
spec = importlib.util.spec_from_file_location("side_by_side", SCRIPT)
sbs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sbs)


def test_bytes_floor_counts_weights_per_decode_step_and_every_decoded_tokens_context():
    # the bench model's shape: 8 layers, hidden 512, 8 / 4 heads of 64, MLP 1408, vocabulary 32,000
    model = ModelSpec("bench", 512, 8, 8, 4, 64, 1408, 32000, 4096, True)
    info = SimpleNamespace(spec=model, hidden_size=512, vocab_size=32000)
    requests = [SimpleNamespace(prompt_len=10, max_tokens=3), SimpleNamespace(prompt_len=100, max_tokens=1)]
    f = sbs.bytes_floor(info, requests, prefill_s=0.5, dtype="float32")
    layer = 512 * (512 + 2 * 256) + 512 * 512 + 3 * 512 * 1408  # qkv, o, gate_up and down
    # the longest output less its first token: 2 decode steps, each streaming every layer and the lm_head
    assert round(f["weight_gb"] * 1e9) == 2 * (8 * layer + 512 * 32000) * 4
    # request 1 decodes tokens 2 and 3 over 11 and 12 keys; request 2 decodes nothing; 8 layers of K and V
    assert round(f["kv_gb"] * 1e9) == (11 + 12) * 8 * 2 * 256 * 4
    assert f["read_gbs"] > 0
    assert abs(f["bytes_floor_s"] - (f["weight_gb"] + f["kv_gb"]) / f["read_gbs"]) < 1e-9
    assert abs(f["floor_mixed_s"] - (0.5 + f["bytes_floor_s"])) < 1e-12
    half = sbs.bytes_floor(info, requests, prefill_s=0.5, dtype="bfloat16")
    assert half["weight_gb"] * 2 == f["weight_gb"] and half["kv_gb"] * 2 == f["kv_gb"]
