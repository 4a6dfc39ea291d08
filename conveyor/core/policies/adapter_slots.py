"""Which waiting request the LoRA adapter slots let join the batch. PURE PYTHON.

A batch holds at most ``max_loras`` distinct adapters (vLLM's ``--max-loras``: the runner keeps that many adapters'
weights in its slots). A request whose adapter is already running, or that has none, always fits; one of a new
adapter fits while a slot is free. The one that does not fit waits at the head of the queue, in order, until a
running adapter's last request ends (nobody behind it jumps it, as with blocks).
"""

from __future__ import annotations

from collections.abc import Iterable

from conveyor.core.request import Request


def running_adapters(running: Iterable[Request]) -> set:
    """The distinct LoRA adapters of ``running``."""
    return {r.sampling_params.lora for r in running if r.sampling_params.lora is not None}


class AdapterSlots:
    """The admission bound on distinct adapters in the batch (``max_loras`` >= 1). Per step: ``begin`` with the
    running requests, then ``admits`` / ``admitted`` for each waiting request in queue order."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 for adapter slots, got {max_loras}")
        self.max_loras = max_loras
        self._held: set = set()

    def begin(self, running: Iterable[Request]) -> None:
        self._held = running_adapters(running)

    def admits(self, request: Request) -> bool:
        lora = request.sampling_params.lora
        return lora is None or lora in self._held or len(self._held) < self.max_loras

    def admitted(self, request: Request) -> None:
        if request.sampling_params.lora is not None:
            self._held.add(request.sampling_params.lora)

    def check_invariants(self, running: Iterable[Request]) -> None:
        assert len(running_adapters(running)) <= self.max_loras, "more running LoRA adapters than max_loras"
