"""Model families and loading. ``load_model(name | path | None) -> (model, ModelInfo)``; None: the default model.

The names below are imported on first use (PEP 562), so a process that only reads a submodule without torch
(the API process reads ``pooling_config``'s choices for its flags) does not import torch through this package:
torch alone is about 200 MiB of resident memory there."""

from __future__ import annotations

import importlib

_EXPORTS = {"ModelInfo": "conveyor.models.build", "EMBEDDED_NAME": "conveyor.models.sources",
            "load_model": "conveyor.models.loader", "DEFAULT_MODEL": "conveyor.models.sources"}

__all__ = ["DEFAULT_MODEL", "EMBEDDED_NAME", "ModelInfo", "load_model"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'conveyor.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
