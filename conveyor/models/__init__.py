"""Model families and loading. ``load_model(path | None) -> (model, ModelInfo)``."""

from conveyor.models.loader import EMBEDDED_NAME, ModelInfo, load_model

__all__ = ["EMBEDDED_NAME", "ModelInfo", "load_model"]
