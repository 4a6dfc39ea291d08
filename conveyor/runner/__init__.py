"""The torch executor: ModelRunner.execute(SchedulerOutput) -> ModelOutput."""

from conveyor.runner.model_runner import ModelRunner

__all__ = ["ModelRunner"]
