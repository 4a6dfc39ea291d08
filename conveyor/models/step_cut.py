"""The flag word that cuts a model's forward pass short between decoder layers (``core.policies.step_cut`` says
when; ``engine.step_cut`` raises it from the thread that reads arrivals).

The per-layer path reads it before each layer; the native layer stack (``models.native_stack``) is handed its
address and reads it there (``cvk.h``: ``CvkLayerStackArgs.stop``). Either way the forward raises ``StepCut`` and
nothing of the step is sampled: the K/V the layers before the cut wrote sits in blocks whose tokens the step
computes again later (and which the prefix cache does not offer meanwhile: ``Scheduler.drop_cut_step``).
"""

from __future__ import annotations

import ctypes


class StepCut(Exception):
    """The forward pass stopped before layer ``layer`` (``native``: inside the native layer stack)."""

    def __init__(self, layer: int | None, native: bool) -> None:
        super().__init__(f"step cut short before layer {layer}" if layer is not None else "step cut short")
        self.layer, self.native = layer, native


class CutFlag:
    """A 32-bit word another thread sets to 1 (``raise_``) and the forward reads between layers, and the number of
    layers before which a cut may stop this step (``cut_layers``; 0: the step in flight may not be cut)."""

    def __init__(self) -> None:
        self.word = ctypes.c_int32(0)
        self.cut_layers = 0

    @property
    def address(self) -> int:
        return ctypes.addressof(self.word)

    @property
    def raised(self) -> bool:
        return self.word.value != 0

    def raise_(self) -> None:
        self.word.value = 1

    def clear(self) -> None:
        self.word.value = 0

    def check(self, layer: int) -> None:
        """Raise ``StepCut`` when the flag is up and the step may stop before ``layer``."""
        if 0 < layer < self.cut_layers and self.word.value:
            raise StepCut(layer, native=False)
