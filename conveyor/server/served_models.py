"""The models one server serves and which of them answers a request: by the request's ``model`` field, else by
what the endpoint asks for (a generation route the generation model, an embeddings route the embedding model).

Every route looks its model up through a ``ModelRouter``: ``ServedModels``, engines loaded before the server starts
and kept for its life (``conveyor serve --model X --embedding-model Y``), or ``model_pool.ModelPool``, models
loaded on demand and unloaded when idle (``--models-dir``, ``--model NAME=PATH``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from conveyor.server.errors import APIError, bad_request
from conveyor.server.serving_common import ServingContext

TASK_WORDS = {"generate": "text generation", "embed": "embeddings", "score": "scores (rerank / score)"}


@dataclass(frozen=True)
class ModelEntry:
    """One servable model as the listings show it (``/v1/models``, ``/api/tags``, ``/api/ps``, ``/health``).
    ``state``: "loaded", "loading", "unloaded" or "failed" (its last load failed); ``ctx`` while loaded;
    ``expires_at``: the Unix time an idle loaded model unloads (None: it stays loaded); ``parent``: a LoRA
    adapter's base model (None: a model of its own)."""

    name: str
    state: str
    ctx: ServingContext | None = None
    path: str | None = None
    expires_at: float | None = None
    in_flight: int = 0
    parent: str | None = None


class ModelRouter(Protocol):
    """How routes find the model a request names.

    ``resolve`` returns the context serving ``task`` for ``name`` (None: the server's default for the task; a
    task of None: whatever task the model serves),
    loading the model first where the router loads on demand: 404 (``model_not_found``) for a name it does not
    serve, 400 naming ``model`` for a model of another task, 5xx when the model cannot be loaded. The model stays
    in use until the HTTP response that asked for it has ended. ``keep_alive_s``: how long the model stays
    loaded once idle after this request (None: the server's default; negative: until the server stops; 0: unload
    as soon as it is idle); a router that never unloads ignores it. ``entries`` lists every servable model."""

    async def resolve(self, name: str | None, task: str | None,
                      keep_alive_s: float | None = None) -> ServingContext: ...

    def entries(self) -> list[ModelEntry]: ...


def not_found(name: str, served: list[str]) -> APIError:
    return APIError(404, f"The model `{name}` does not exist; this server serves "
                    f"{', '.join(f'`{n}`' for n in served)}.", "model", "model_not_found")


def check_task(ctx: ServingContext, task: str | None) -> ServingContext:
    if task is not None and ctx.task != task:
        raise bad_request(f"model: `{ctx.model_name}` is a {TASK_WORDS[ctx.task]} model; it does not serve "
                          f"{TASK_WORDS[task]}", "model")
    return ctx


class ServedModels:
    """A ``ModelRouter`` over serving contexts loaded for the server's life, in the order added (the first is the
    server's primary model)."""

    def __init__(self) -> None:
        self.contexts: dict[str, ServingContext] = {}

    def add(self, ctx: ServingContext) -> None:
        if ctx.model_name in self.contexts:
            raise ValueError(f"two served models are named {ctx.model_name!r}: pass --served-model-name")
        self.contexts[ctx.model_name] = ctx

    def for_request(self, name: str | None, task: str | None) -> ServingContext:
        """The context that serves ``task`` for a request naming ``name`` (None: the first that serves it). 404
        for an unknown name, 400 naming ``model`` for a model of another task."""
        if name is not None:
            ctx = self.contexts.get(name)
            if ctx is None:
                raise not_found(name, list(self.contexts))
        else:
            ctx = next((c for c in self.contexts.values() if task in (None, c.task)), next(iter(self.contexts.values())))
        return check_task(ctx, task)

    async def resolve(self, name: str | None, task: str | None,
                      keep_alive_s: float | None = None) -> ServingContext:
        return self.for_request(name, task)

    def entries(self) -> list[ModelEntry]:
        return [ModelEntry(name, "loaded", ctx, ctx.engine.info.args.model, None, ctx.engine.num_in_flight)
                for name, ctx in self.contexts.items()]
