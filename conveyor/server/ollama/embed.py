"""Ollama's embedding routes, an adapter over the one embedding path (``serving_pooling.embed``): ``/api/embed``
(``input`` a string or a list of them; unit-length vectors, as Ollama's are; ``truncate`` true cuts an input to the
model's context, false makes a longer one a 400; ``dimensions``) and the older ``/api/embeddings`` (one ``prompt``;
the vector as the model pools it, not normalised, as Ollama's). The model is named as Ollama clients send it (with
or without a ``:tag``), among every model the server serves; errors are Ollama's ``{"error": "..."}``."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from conveyor.server.errors import bad_request
from conveyor.server.fields import Bool, Float, PositiveInt
from conveyor.server.ollama.model_card import served_name
from conveyor.server.ollama.protocol import Options, keep_alive_seconds
from conveyor.server.served_models import ModelRouter
from conveyor.server.serving_common import ServingContext
from conveyor.server.serving_pooling import embed


class EmbedRequest(BaseModel):
    """``/api/embed``'s body."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    input: str | list[str] = ""
    truncate: Bool = True
    dimensions: PositiveInt | None = None
    options: Options | None = None
    keep_alive: str | Float | None = None


class EmbeddingsRequest(BaseModel):
    """``/api/embeddings``' body (Ollama's older route)."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    prompt: str = ""
    options: Options | None = None
    keep_alive: str | Float | None = None


async def embedding_context(served: ModelRouter, name: str, keep_alive=None) -> ServingContext:
    """The served model ``name`` names (Ollama's spelling), loaded, which must make embeddings: else Ollama's 404 /
    400."""
    ctx = await served.resolve(served_name([e.name for e in served.entries()], name), None,
                               keep_alive_seconds(keep_alive))
    if ctx.task != "embed":
        raise bad_request(f'"{ctx.model_name}" does not support embeddings', "model")
    return ctx


async def _vectors(served: ModelRouter, raw: Request, name: str, texts: list[str], truncate: bool,
                   dimensions: int | None, normalize: bool, options: Options | None, keep_alive):
    if options is not None:
        options.checked()
    ctx = await embedding_context(served, name, keep_alive)
    started = time.monotonic_ns()
    _, outputs = await embed(ctx, raw, texts, -1 if truncate else None, dimensions, normalize, prefix="ollama")
    stats = {"total_duration": time.monotonic_ns() - started, "load_duration": 0,
             "prompt_eval_count": sum(len(o.prompt_token_ids) for o in outputs)}
    return [o.pooled for o in outputs], stats


def install_ollama_embed_routes(app: FastAPI, served: ModelRouter) -> None:
    @app.post("/api/embed")
    async def ollama_embed(body: EmbedRequest, raw: Request):
        texts = ([body.input] if body.input else []) if isinstance(body.input, str) else list(body.input)
        if not texts:  # Ollama's answer to nothing to embed (it loads the model): no vectors
            await embedding_context(served, body.model, body.keep_alive)
            return {"model": body.model, "embeddings": []}
        vectors, stats = await _vectors(served, raw, body.model, texts, body.truncate, body.dimensions, True,
                                        body.options, body.keep_alive)
        return {"model": body.model, "embeddings": vectors, **stats}

    @app.post("/api/embeddings")
    async def ollama_embeddings(body: EmbeddingsRequest, raw: Request):
        if not body.prompt:
            await embedding_context(served, body.model, body.keep_alive)
            return {"embedding": []}
        vectors, _ = await _vectors(served, raw, body.model, [body.prompt], True, None, False, body.options,
                                    body.keep_alive)
        return {"embedding": vectors[0]}
