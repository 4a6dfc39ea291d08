"""The served model as Ollama's clients ask about it: its names (``name:tag``), and its entries in ``/api/tags``,
``/api/show`` and ``/api/ps``, from the engine's fixed facts (``EngineInfo``)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from conveyor.server.errors import APIError
from conveyor.server.serving_common import ServingContext

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def _parameter_size(n: int) -> str:
    """Ollama's spelling: 135M, 7.6B."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{round(n / 1e6)}M"


def served_name(served: list[str], name: str | None) -> str:
    """The served model ``name`` stands for (an exact name first, else Ollama's spelling); else Ollama's 404."""
    match = [n for n in served if n == name] or [n for n in served if name and name_matches(name, n)]
    if not match:
        raise APIError(404, f"model {name!r} not found, try pulling it first", "model", "model_not_found")
    return match[0]


def name_matches(name: str, served: str) -> bool:
    """Whether ``name``, as an Ollama client sends it (``model`` or ``model:tag``, any case), names ``served``."""
    wanted, served = name.lower(), served.lower()
    return wanted == served or (":" in wanted and wanted.rsplit(":", 1)[0] == served)


@dataclass(frozen=True)
class ModelCard:
    name: str  # the served name
    family: str
    num_params: int
    dtype: str
    quantization: str
    context_length: int
    template: str
    size: int  # bytes of weights in memory (an estimate from the parameter count and dtype)
    thinks: bool
    loaded_at: datetime
    file_format: str | None = None  # "gguf" or "safetensors" where known from the files (else from quantization)

    @classmethod
    def of(cls, ctx: ServingContext) -> ModelCard:
        info = ctx.engine.info
        model = info.model_info
        quantization = info.args.quantization
        return cls(ctx.model_name, str(model.architecture).lower().removesuffix("forcausallm") or "llama",
                   int(model.num_params), str(model.dtype),
                   quantization if quantization not in ("auto", "none") else str(model.dtype).upper(),
                   info.max_model_len, info.tokenizer.chat_template or "",
                   int(model.num_params) * DTYPE_BYTES.get(str(model.dtype), 4), ctx.reasoning is not None,
                   datetime.now(timezone.utc))

    @classmethod
    def on_disk(cls, name: str, path: str | None) -> ModelCard:
        """A model that is not loaded, as far as its files tell without reading them: its size on disk."""
        size, modified = 0, datetime.now(timezone.utc)
        if path and os.path.exists(path):
            files = [Path(path)] if os.path.isfile(path) else [p for p in Path(path).rglob("*") if p.is_file()]
            size = sum(p.stat().st_size for p in files)
            modified = datetime.fromtimestamp(os.path.getmtime(path), timezone.utc)
        file_format = "gguf" if path and path.endswith(".gguf") else "safetensors"
        return cls(name, "", 0, "", "", 0, "", size, False, modified, file_format)

    def names(self, name: str) -> bool:
        """Whether ``name`` (as an Ollama client sends it: ``model``, ``model:tag``) is the served model."""
        return name_matches(name, self.name)

    @property
    def tagged(self) -> str:
        return self.name if ":" in self.name else f"{self.name}:latest"

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.name}/{self.dtype}/{self.num_params}".encode()).hexdigest()

    def details(self) -> dict:
        file_format = self.file_format or ("gguf" if self.quantization.startswith("Q") else "safetensors")
        return {"parent_model": "", "format": file_format,
                "family": self.family, "families": [self.family] if self.family else [],
                "parameter_size": _parameter_size(self.num_params) if self.num_params else "",
                "quantization_level": self.quantization}

    def listed(self) -> dict:
        """The model's entry in ``/api/tags``."""
        return {"name": self.tagged, "model": self.tagged, "modified_at": self.loaded_at.isoformat(),
                "size": self.size, "digest": self.digest, "details": self.details()}

    def shown(self) -> dict:
        """``/api/show``: the template, details, model info and capabilities."""
        capabilities = ["completion", "tools"] + (["thinking"] if self.thinks else [])
        return {"modelfile": f"FROM {self.name}\n", "parameters": "", "template": self.template,
                "details": self.details(), "modified_at": self.loaded_at.isoformat(),
                "model_info": {"general.architecture": self.family, "general.parameter_count": self.num_params,
                               f"{self.family}.context_length": self.context_length},
                "capabilities": capabilities}

    def running(self, expires_at: float | None = None) -> dict:
        """The model's entry in ``/api/ps``: loaded until ``expires_at`` (Unix time; None: as long as the server
        runs)."""
        expires = (datetime.now(timezone.utc) + timedelta(days=3650) if expires_at is None
                   else datetime.fromtimestamp(expires_at, timezone.utc))
        return {**self.listed(), "expires_at": expires.isoformat(), "size_vram": 0,
                "context_length": self.context_length}

