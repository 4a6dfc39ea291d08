"""Model families and loading. ``load_model(name | path | None) -> (model, ModelInfo)``; None: the default model."""

from conveyor.models.loader import ModelInfo, load_model
from conveyor.models.sources import DEFAULT_MODEL, EMBEDDED_NAME

__all__ = ["DEFAULT_MODEL", "EMBEDDED_NAME", "ModelInfo", "load_model"]
