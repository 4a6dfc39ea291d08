"""What a multi-model server can serve: ``--models-dir DIR`` (each GGUF file or model directory in it is a model,
named by its file or directory name) and repeated ``--model NAME=PATH``. Names map to paths; nothing is loaded
here (``model_pool.ModelPool`` loads on demand)."""

from __future__ import annotations

import os
from pathlib import Path

GGUF_SUFFIX = ".gguf"


def split_named_model(text: str) -> tuple[str, str] | None:
    """``NAME=PATH`` as (name, path); None for a plain model (a name, file or directory that exists as given)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path or os.path.exists(text):
        return None
    return name, path


def _is_model_dir(path: Path) -> bool:
    """A Hugging Face model directory (``config.json``) or a directory holding a GGUF file."""
    try:
        return (path / "config.json").is_file() or any(p.suffix == GGUF_SUFFIX for p in path.iterdir())
    except OSError:
        return False


def scan_models_dir(directory: str) -> dict[str, str]:
    """The models in ``directory``, name -> path, sorted by name: each ``NAME.gguf`` file and each directory that
    holds a model (its name); hidden entries and anything else are skipped."""
    found: dict[str, str] = {}
    for entry in sorted(Path(directory).iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_file() and entry.suffix == GGUF_SUFFIX:
            found.setdefault(entry.stem, str(entry))
        elif entry.is_dir() and _is_model_dir(entry):
            found.setdefault(entry.name, str(entry))
    return found


class ModelCatalog:
    """Served names -> model paths: the ``--model NAME=PATH`` entries (in their order), then ``--models-dir``'s,
    which is scanned again on ``refresh`` (a model copied into the directory is served without a restart; a name
    given by ``--model`` wins over the directory's)."""

    def __init__(self, named: list[tuple[str, str]] = (), models_dir: str | None = None) -> None:
        if models_dir is not None and not Path(models_dir).is_dir():
            raise ValueError(f"--models-dir {models_dir}: not a directory")
        self.named: dict[str, str] = {}
        for name, path in named:
            if name in self.named:
                raise ValueError(f"two models are named {name!r} (--model {name}=...)")
            self.named[name] = path
        self.models_dir = models_dir
        self.paths: dict[str, str] = {}
        self.refresh()
        if not self.paths:
            raise ValueError(f"no models to serve: {models_dir} holds no GGUF file or model directory")

    def refresh(self) -> None:
        found = scan_models_dir(self.models_dir) if self.models_dir is not None else {}
        self.paths = {**self.named, **{k: v for k, v in found.items() if k not in self.named}}

    def path_of(self, name: str) -> str | None:
        """The path served as ``name``; looks in the directory again before giving up."""
        if name not in self.paths:
            self.refresh()
        return self.paths.get(name)

    @property
    def names(self) -> list[str]:
        return list(self.paths)
