"""Quantized weights in a model: which parameters stay quantized, and the modules that run them.

A GGUF file's linear weights (and its token embedding) stay in their blocks when the CPU kernels built and the
type has a kernel (``layers.gguf_blocks.GGUF_KERNEL_TYPES``); ``--quantization int8`` turns a float checkpoint's
decoder linears into int8 at load. Everything else (norms, biases, a tensor in a type without a kernel, a fused
parameter any of whose parts is such a tensor) is loaded in the engine's float dtype as before.

``plan_gguf`` decides from the tensor directory alone (before anything is read), so that the parameters it keeps
quantized never get float storage; ``install`` then swaps their modules for ``QuantLinear`` / ``QuantEmbedding``.
A tied model's lm_head shares its embedding's packed table (held once).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

from conveyor.core.config import QUANTIZATION_CHOICES
from conveyor.layers.gguf_blocks import GGUF_KERNEL_TYPES
from conveyor.layers.quantized import QuantEmbedding, QuantizedStack, QuantizedTensor, QuantLinear, quantize_int8
from conveyor.layers.w8a8 import W8A8Linear
from conveyor.models.moe import RouterLinear, SparseMoE

logger = logging.getLogger("conveyor.models")
__all__ = ["QUANTIZATION_CHOICES", "describe", "install", "plan_gguf", "quantize_linears_int8"]


def plan_gguf(model: nn.Module, tensors: dict, parts_of) -> dict[str, list[tuple[str, int | None]]]:
    """{model parameter -> the GGUF parts that fill it, as (tensor name, expert slice or None)} for every linear
    or embedding weight all of whose parts have a kernel. ``tensors``: the file's directory (name -> TensorInfo);
    ``parts_of``: GGUF name -> its (HF name, expert slice) parts (``gguf_model.gguf_parts``)."""
    parts: dict[str, list[tuple[int, str, int | None, bool]]] = defaultdict(list)
    for name, info in tensors.items():
        for target_name, expert in parts_of(name):
            if not target_name.endswith(".weight") or len(info.shape) != (2 if expert is None else 3):
                continue
            target = model.map_weight(target_name)
            if target is None or not _quantizable(model, target.param):
                continue
            parts[target.param].append((target.offset or 0, name, expert, info.qtype.name in GGUF_KERNEL_TYPES))
    return {param: [(name, expert) for _, name, expert, _ in sorted(p, key=lambda part: part[0])]
            for param, p in parts.items() if all(ok for *_, ok in p)}


def _quantizable(model: nn.Module, param: str) -> bool:
    """Whether ``param`` is the weight of a linear layer (not a mixture's router) or of the token embedding."""
    module_name, _, leaf = param.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    linear = isinstance(module, nn.Linear) and not isinstance(module, RouterLinear)
    return leaf == "weight" and (linear or module is model.get_input_embeddings())


def install(model: nn.Module, weights: dict[str, QuantizedTensor | QuantizedStack], kernels,
            dtype: torch.dtype) -> list[str]:
    """Replace the module of each parameter in ``weights`` (name -> its whole QuantizedTensor, or the stack of its
    parts in layouts that stay apart) with its quantized form; returns the parameters made quantized (the tied
    lm_head included), for the start-up log."""
    done = []
    embed = model.get_input_embeddings()
    for param, quant in weights.items():
        module_name = param.rpartition(".")[0]
        module = model.get_submodule(module_name)
        if module is embed:
            new = QuantEmbedding(quant, kernels, dtype)
        else:
            new = QuantLinear(quant, module.bias, kernels, dtype)
        _set_submodule(model, module_name, new)
        done.append(param)
    embedding = model.get_input_embeddings()
    if getattr(model, "lm_head", "absent") is None and isinstance(embedding, QuantEmbedding):
        model.lm_head = QuantLinear(embedding.quant, None, kernels, dtype)  # the same packed table, held once
        done.append("lm_head.weight (tied)")
    return done


def quantize_linears_int8(model: nn.Module, kernels, dtype: torch.dtype, w8a8: bool = False) -> list[str]:
    """``--quantization int8``: every decoder linear of a loaded float model to per-channel int8 (vLLM-cpu's W8A8
    weights), a mixture's experts included. The embedding, lm_head and a mixture's routers stay float, as vLLM's
    W8A8 checkpoints keep them. ``w8a8`` (``--quantization w8a8``): the same weights as ``W8A8Linear``s, whose
    activations are 8-bit per token (``layers.w8a8``); not for a mixture of experts (its routed MLP runs the
    block-quantized kernel only: ValueError)."""
    if w8a8 and any(isinstance(m, SparseMoE) for m in model.modules()):
        raise ValueError("--quantization w8a8 does not run a mixture of experts' routed MLP; use "
                         "--quantization int8 (the same int8 weights, 15-bit activations)")
    done = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not isinstance(module, RouterLinear) and name != "lm_head":
            if w8a8:
                new = W8A8Linear.from_float(module.weight, module.bias, kernels, dtype)
            else:
                new = QuantLinear(quantize_int8(module.weight), module.bias, kernels, dtype)
            _set_submodule(model, name, new)
            done.append(name + ".weight")
    return done


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


def describe(done: list[str], model: nn.Module) -> str:
    """One start-up log line: how many weights run quantized, in which formats, and what stayed float."""
    if not done:
        return "weights: every weight in the float dtype (none kept quantized)"
    sources: dict[str, int] = defaultdict(int)
    packed: dict[int, int] = {}  # one entry per packed table: a tied lm_head shares its embedding's
    float_linears = 0
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            sources[module.quant.sources] += 1
            packed[id(module.quant)] = module.quant.nbytes
        elif isinstance(module, nn.Linear) or type(module).__name__ == "PackedLinear":
            float_linears += 1
    formats = ", ".join(f"{n} {s}" for s, n in sorted(sources.items()))
    tail = f"; {float_linears} linear layers in float" if float_linears else ""
    return (f"weights: {len(done)} run quantized on the integer kernels ({formats}; "
            f"{sum(packed.values()) / 2**20:.0f} MiB packed){tail}")
