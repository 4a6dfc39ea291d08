"""A decoder's linear layers given LoRA adapter slots (``layers.lora``), and adapters put into them.

``LoRAModel(model, num_slots, max_rank, kernels)`` wraps every layer's ``qkv_proj`` (parts q, k, v), ``o_proj``,
``gate_up_proj`` (parts gate, up) and ``down_proj`` in a ``LoRALinear`` and sets ``model.lora`` to the shared
``LoRAStep``; a model with a native layer stack runs its adapter steps there too (``NativeLayerStack.attach_lora``),
a step without adapter rows runs as before. Slots hold ``adapter_dtype(model)``. ``load(slot, adapter)`` installs a
``models.lora_format.LoRAAdapter``.
"""

from __future__ import annotations

import torch

from conveyor.layers.lora import LoRALinear, LoRAStep
from conveyor.layers.quantized import QuantLinear
from conveyor.models.lora_format import LoRAAdapter, LoRABase, lora_base_of

# fused projection -> its parts (adapter module names), in output-column order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up_proj": ("gate_proj", "up_proj"),
         "down_proj": ("down_proj",)}


def adapter_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype adapter slots hold for ``model``: bfloat16 where the base already computes in bfloat16 or with
    quantized weights, float32 for a float32 base (exact to peft's merged model within float32 rounding).

    Why: a decode step streams every slot's A and B with rows in it, and 8 rank-16 float32 adapters on SmolLM2 are
    about 2.4x its Q4_1 layer's bytes; bfloat16 halves them. Its rounding (relative 2^-9 per weight) sits far
    below what 4- or 8-bit base weights (or bfloat16 activations) already change, while a float32 base keeps
    float32 adapters."""
    layer = model.layers[0]
    quantized = any(isinstance(getattr(owner, name, None), QuantLinear)
                    for owner in (layer.self_attn, layer.mlp) for name in FUSED)
    bfloat16 = layer.input_layernorm.weight.dtype == torch.bfloat16
    return torch.bfloat16 if quantized or bfloat16 else torch.float32


class LoRAModel:
    """A decoder model's adapter slots (module doc)."""

    def __init__(self, model: torch.nn.Module, num_slots: int, max_rank: int, device: torch.device, kernels=None,
                 segmented: bool = True, weight_dtype: torch.dtype | None = None) -> None:
        self.base: LoRABase = lora_base_of(model.config)
        if self.base.unsupported:
            raise ValueError(f"--enable-lora: this model carries no LoRA adapter: {self.base.unsupported}")
        self.num_slots, self.max_rank = num_slots, max_rank
        self.device = device  # (not a weight's: a GGUF model's may sit on the meta device, their data elsewhere)
        self.step = LoRAStep(kernels, segmented)
        self.weight_dtype = weight_dtype or adapter_dtype(model)
        self.linears: list[dict[str, LoRALinear]] = []
        shapes = self.base.shapes
        for layer in model.layers:
            wrapped = {}
            for owner in (layer.self_attn, layer.mlp):
                for fused, parts in FUSED.items():
                    base = getattr(owner, fused, None)
                    if base is None:
                        continue
                    cols, start = [], 0
                    for part in parts:
                        cols.append((start, start + shapes[part][1]))
                        start += shapes[part][1]
                    lin = LoRALinear(base, self.step, cols, shapes[parts[0]][0], num_slots, max_rank, device,
                                     self.weight_dtype)
                    setattr(owner, fused, lin)
                    wrapped[fused] = lin
            self.linears.append(wrapped)
        model.lora = self.step
        if kernels is not None and segmented and model.native_stack is not None:
            model.native_stack.attach_lora(self.step, self.linears)  # adapter steps keep the one-call stack

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Install ``adapter`` in ``slot`` (whatever was there is overwritten)."""
        for layer, wrapped in enumerate(self.linears):
            for fused, lin in wrapped.items():
                lin.load_slot(slot, [adapter.weights.get((layer, part)) for part in FUSED[fused]])
