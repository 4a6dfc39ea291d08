"""The runner's LoRA adapter slots: which adapter is in which slot, adapters swapped in least recently used first,
and each step's rows mapped to their adapter's slot (``layers.lora.LoRAStep``).

The scheduler admits at most ``max_loras`` (the slot count) distinct adapters into the running batch, so the
adapters of every request the runner holds fit the slots together; a slot is only ever taken from an adapter
none of them runs with. An adapter is read from its directory (``models.lora_format.read_adapter``) when it
enters a slot; one that fails to read fails its requests with the reason, and the rest of the step runs.
"""

from __future__ import annotations

from collections import OrderedDict

from conveyor.core.lora_request import LoRARequest
from conveyor.models.lora_format import AdapterError, read_adapter
from conveyor.models.lora_model import LoRAModel


class LoRASlots:
    """Adapter slots of one model (module doc)."""

    def __init__(self, lora_model: LoRAModel) -> None:
        self.model = lora_model
        self.slot_of: OrderedDict[LoRARequest, int] = OrderedDict()  # least recently used first
        self.free = list(range(lora_model.num_slots - 1, -1, -1))
        self.num_loads = 0  # adapters read into a slot (swaps included), for tests and metrics

    def _slot(self, lora: LoRARequest, held: set[LoRARequest]) -> int:
        slot = self.slot_of.get(lora)
        if slot is not None:
            self.slot_of.move_to_end(lora)
            return slot
        adapter = read_adapter(lora.lora_path, self.model.base, self.model.max_rank)
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((each for each in self.slot_of if each not in held), None)
            if victim is None:
                raise RuntimeError(f"LoRA: every one of the {self.model.num_slots} adapter slots holds an adapter "
                                   f"of a running request (the scheduler admits at most --max-loras adapters)")
            slot = self.slot_of.pop(victim)
        self.model.load(slot, adapter)
        self.slot_of[lora] = slot
        self.num_loads += 1
        return slot

    def prepare(self, step, requests: dict) -> None:
        """Map ``step``'s rows (``runner.input_batch.StepInputs``) to their requests' adapter slots; a request
        whose adapter cannot be read gets that as its error (its rows run on the base weights, its token is
        discarded). ``requests``: the runner's request states by id (every request of the running batch)."""
        held = {s.params.lora for s in requests.values() if s.params.lora is not None}
        starts = step.attn_meta.query_start_loc
        spans = []
        for i, rid in enumerate(step.req_ids):
            state = requests[rid]
            lora = state.params.lora
            if lora is None or state.error is not None:
                continue
            try:
                slot = self._slot(lora, held)
            except AdapterError as exc:
                state.error = str(exc)
                continue
            spans.append((starts[i], starts[i + 1], slot))
        self.model.step.set(spans, self.model.device)

    def done(self) -> None:
        """The step's forward pass is over: later calls of the model (another engine's, a test's) run bare."""
        self.model.step.clear()
