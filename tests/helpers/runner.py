"""A ModelRunner that keeps the logits it sampled from (drive it by hand with ``conveyor.bench.step_builder``)."""

from __future__ import annotations

import torch

from conveyor.core.outputs import ModelOutput
from conveyor.runner.input_batch import StepInputs
from conveyor.runner.model_runner import ModelRunner


class LogitsRecordingRunner(ModelRunner):
    """Keeps the logits of the last step's sampling rows in ``last_logits`` ({req_id: [vocab] float tensor})."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.last_logits: dict[str, torch.Tensor] = {}

    def sample(self, logits: torch.Tensor, step: StepInputs, masks=None) -> ModelOutput:
        self.last_logits = {r.req_id: logits[i].float().clone() for i, r in enumerate(step.sampling)}
        return super().sample(logits, step, masks)
