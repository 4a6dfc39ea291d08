"""Model families and loading. ``load_model(name | path | None) -> (model, ModelInfo)``; None: the default model."""

from conveyor.models.build import ModelInfo
from conveyor.models.embedded import EMBEDDED_NAME
from conveyor.models.loader import load_model
from conveyor.models.sources import DEFAULT_MODEL

__all__ = ["DEFAULT_MODEL", "EMBEDDED_NAME", "ModelInfo", "load_model"]
