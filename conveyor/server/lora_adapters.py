"""LoRA adapters served by name (``--enable-lora``): ``--lora-modules name=path ...`` at start, and vLLM's
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` while running.

``LoRAAdapters`` is a ``ModelRouter`` over the server's own: a request whose ``model`` names an adapter gets the
base model's serving context with that adapter (``ServingContext.for_adapter``), so every protocol (OpenAI,
Anthropic, Responses, Ollama) runs it through the one internal path, and its ``SamplingParams.lora`` carries it to
the engine. An adapter is read and checked against the base model here before it is listed
(``models.lora_format``: a wrong shape, a rank above ``--max-lora-rank``, a missing file or an unsupported
feature is a 400 naming why); the engine reads it again into a slot when a request first needs it.
``/v1/models`` lists each adapter with ``parent`` = the base model's name.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from conveyor.core.lora_request import LoRARequest
from conveyor.models.lora_format import AdapterError, check_adapter
from conveyor.server.errors import APIError, bad_request
from conveyor.server.served_models import ModelEntry, ModelRouter, check_task
from conveyor.server.serving_common import ServingContext


def parse_lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """``--lora-modules`` values as (name, path): ``name=path``, or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``. ValueError naming the bad one."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {value!r} is not a JSON object with name and path") from None
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules: {value!r} is not name=path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules: {value!r} needs a non-empty name and path")
        modules.append((name, path))
    return modules


class LoRAAdapters:
    """The served adapters of one base model, in front of the server's ``ModelRouter`` (module doc)."""

    def __init__(self, inner: ModelRouter, base: ServingContext) -> None:
        self.inner, self.base = inner, base
        self.adapters: dict[str, ServingContext] = {}
        self._ids = itertools.count(1)  # each load a new id: a reloaded name never shares cached KV with the old

    def _checked(self, name: str, path: str, replace: bool = False) -> LoRARequest:
        """The adapter ``name`` at ``path``, read and checked (APIError 400 naming why it is refused)."""
        if not name or not path:
            raise bad_request("lora_name and lora_path must both be given", "lora_name" if not name else "lora_path")
        if name in self.adapters and not replace:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if name != self.base.model_name and any(e.name == name for e in self.inner.entries()):
            raise bad_request(f"lora_name: '{name}' is the name of a served model", "lora_name")
        if name == self.base.model_name:
            raise bad_request(f"lora_name: '{name}' is the base model's name", "lora_name")
        info = self.base.engine.info
        path = os.path.abspath(path)
        try:
            check_adapter(path, info.model_info.lora_base, info.args.max_lora_rank)
        except AdapterError as exc:
            raise bad_request(str(exc), "lora_path") from None
        return LoRARequest(name, next(self._ids), path)

    def add(self, name: str, path: str, replace: bool = False) -> None:
        """Serve the adapter at ``path`` as ``name`` (APIError 400 naming why not)."""
        lora = self._checked(name, path, replace)
        self.adapters[name] = self.base.for_adapter(name, lora)

    async def load(self, name: str, path: str, replace: bool = False) -> None:
        """``add`` with the adapter read off the event loop."""
        lora = await asyncio.to_thread(self._checked, name, path, replace)
        self.adapters[name] = self.base.for_adapter(name, lora)

    def remove(self, name: str) -> None:
        """Stop serving adapter ``name`` (404 when it is not served). Its requests in flight finish."""
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found")

    async def resolve(self, name: str | None, task: str | None,
                      keep_alive_s: float | None = None) -> ServingContext:
        ctx = self.adapters.get(name) if name is not None else None
        if ctx is not None:
            return check_task(ctx, task)
        return await self.inner.resolve(name, task, keep_alive_s)

    def entries(self) -> list[ModelEntry]:
        return self.inner.entries() + [
            ModelEntry(name, "loaded", ctx, ctx.lora.lora_path, None, 0, parent=self.base.model_name)
            for name, ctx in self.adapters.items()]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of ``/v1/load_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of ``/v1/unload_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def install_lora_routes(app: FastAPI, adapters: LoRAAdapters) -> None:
    """``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, answering as vLLM's do (plain text on success,
    errors in OpenAI's shape)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        await adapters.load(body.lora_name, body.lora_path, replace=body.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        adapters.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
