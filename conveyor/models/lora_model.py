"""A decoder's linear layers given LoRA adapter slots (``layers.lora``), and adapters put into them.

``LoRAModel(model, num_slots, max_rank, kernels)`` wraps every layer's ``qkv_proj`` (parts q, k, v), ``o_proj``,
``gate_up_proj`` (parts gate, up) and ``down_proj`` in a ``LoRALinear`` and sets ``model.lora`` to the shared
``LoRAStep``: a step with adapter rows runs the per-layer path (the native layer stack computes base weights only),
a step without runs as before. ``load(slot, adapter)`` installs a ``models.lora_format.LoRAAdapter``.
"""

from __future__ import annotations

import torch

from conveyor.layers.lora import LoRALinear, LoRAStep
from conveyor.models.lora_format import LoRAAdapter, LoRABase, lora_base_of

# fused projection -> its parts (adapter module names), in output-column order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up_proj": ("gate_proj", "up_proj"),
         "down_proj": ("down_proj",)}


class LoRAModel:
    """A decoder model's adapter slots (module doc)."""

    def __init__(self, model: torch.nn.Module, num_slots: int, max_rank: int, device: torch.device, kernels=None,
                 segmented: bool = True) -> None:
        self.base: LoRABase = lora_base_of(model.config)
        if self.base.unsupported:
            raise ValueError(f"--enable-lora: this model carries no LoRA adapter: {self.base.unsupported}")
        self.num_slots, self.max_rank = num_slots, max_rank
        self.device = device  # (not a weight's: a GGUF model's may sit on the meta device, their data elsewhere)
        self.step = LoRAStep(kernels, segmented)
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
                    lin = LoRALinear(base, self.step, cols, shapes[parts[0]][0], num_slots, max_rank, device)
                    setattr(owner, fused, lin)
                    wrapped[fused] = lin
            self.linears.append(wrapped)
        model.lora = self.step

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Install ``adapter`` in ``slot`` (whatever was there is overwritten)."""
        for layer, wrapped in enumerate(self.linears):
            for fused, lin in wrapped.items():
                lin.load_slot(slot, [adapter.weights.get((layer, part)) for part in FUSED[fused]])
