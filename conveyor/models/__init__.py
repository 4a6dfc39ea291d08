"""Model families and loading. ``load_model(path | None) -> (model, ModelInfo)``."""

from conveyor.models.build import ModelInfo
from conveyor.models.embedded import EMBEDDED_NAME
from conveyor.models.loader import load_model

__all__ = ["EMBEDDED_NAME", "ModelInfo", "load_model"]
