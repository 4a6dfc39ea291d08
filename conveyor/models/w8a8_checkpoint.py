"""A compressed-tensors W8A8 checkpoint loaded as it is stored (what vLLM loads: ``benchmarks/make_w8a8.py`` writes
one, llm-compressor and others publish them): int8 linear weights with one float scale per output channel
(``X.weight``, ``X.weight_scale``) and a ``quantization_config`` asking for dynamic symmetric int8 activations per
token. Its linears become ``layers.w8a8.W8A8Linear``s on the file's integers (fused q/k/v and gate/up stacked in
row order), everything else loads as a float checkpoint does. A scheme other than that one (static or per-group
activations, asymmetric or non-8-bit weights, other formats) is refused at load, naming the field.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from conveyor.layers.w8a8 import W8A8Linear

# (where in quantization_config, the value conveyor computes)
_SCHEME = (
    (("quant_method",), "compressed-tensors"),
    (("format",), "int-quantized"),
    (("weights", "num_bits"), 8), (("weights", "type"), "int"), (("weights", "symmetric"), True),
    (("weights", "strategy"), "channel"), (("weights", "dynamic"), False),
    (("input_activations", "num_bits"), 8), (("input_activations", "type"), "int"),
    (("input_activations", "symmetric"), True), (("input_activations", "strategy"), "token"),
    (("input_activations", "dynamic"), True),
)


def check_w8a8_config(qc: dict, where: str) -> None:
    """ValueError unless ``qc`` (config.json's quantization_config) is the W8A8 scheme conveyor computes: one group
    targeting Linear, per-channel symmetric int8 weights, dynamic per-token symmetric int8 activations."""
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{where}: quantization_config with {len(groups)} config_groups; conveyor loads one W8A8 group")
    group = next(iter(groups.values()))
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{where}: quantization_config targets {group.get('targets')!r}; conveyor loads ['Linear']")
    for path, want in _SCHEME:
        node = qc if path[0] in ("quant_method", "format") else group
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node != want:
            raise ValueError(f"{where}: quantization_config {'.'.join(path)}={node!r}: conveyor computes W8A8 with "
                             f"{'.'.join(path)}={want!r} only (per-channel int8 weights, dynamic per-token int8 "
                             "activations)")


def split_w8a8(weights, model) -> tuple[list, dict[str, list]]:
    """The checkpoint's tensors -> (the float ones, as (name, tensor) pairs for ``load_into``; per model parameter
    its int8 parts as (row offset, q, scale)). An int8 weight without its scale, or one that maps to a parameter
    that is not a linear layer's (or needs a transpose or a row reorder), is a ValueError."""
    tensors = dict(weights)
    parts: dict[str, list] = defaultdict(list)
    for name, t in list(tensors.items()):
        if t.dtype != torch.int8:
            continue
        scale = tensors.pop(name.removesuffix("weight") + "weight_scale", None)
        del tensors[name]
        target = model.map_weight(name)
        if scale is None or target is None or target.transpose or target.row_order is not None or target.shift:
            raise ValueError(f"int8 tensor {name!r}: not a linear weight with its weight_scale conveyor can load")
        parts[target.param].append((target.offset or 0, t, scale.to(torch.float32).reshape(-1)))
    return list(tensors.items()), parts


def install_w8a8(model, parts: dict[str, list], kernels, dtype: torch.dtype) -> list[str]:
    """Replace each parameter's module with a ``W8A8Linear`` on its parts stacked in row order."""
    done = []
    for param, pieces in parts.items():
        pieces.sort(key=lambda p: p[0])
        module_name = param.rpartition(".")[0]
        module = model.get_submodule(module_name)
        q = torch.cat([p[1] for p in pieces])
        s = torch.cat([p[2] for p in pieces])
        if tuple(q.shape) != tuple(module.weight.shape):
            raise ValueError(f"{param}: int8 parts of shape {tuple(q.shape)}, expected {tuple(module.weight.shape)}")
        parent, _, leaf = module_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf,
                W8A8Linear(q, s, module.bias, kernels, dtype))
        done.append(param)
    return done
