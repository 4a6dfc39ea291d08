"""The models one server serves, each in its own engine, and which of them answers a request: by the request's
``model`` field, else by what the endpoint asks for (a generation route the generation model, an embeddings
route the embedding model). ``conveyor serve --model X --embedding-model Y`` serves two; a later "many models
behind one server" adds more the same way (``add``)."""

from __future__ import annotations

from conveyor.server.errors import APIError, bad_request
from conveyor.server.serving_common import ServingContext

TASK_WORDS = {"generate": "text generation", "embed": "embeddings", "score": "scores (rerank / score)"}


class ServedModels:
    """Serving contexts by served model name, in the order added (the first is the server's primary model)."""

    def __init__(self) -> None:
        self.contexts: dict[str, ServingContext] = {}

    def add(self, ctx: ServingContext) -> None:
        if ctx.model_name in self.contexts:
            raise ValueError(f"two served models are named {ctx.model_name!r}: pass --served-model-name")
        self.contexts[ctx.model_name] = ctx

    def for_request(self, name: str | None, task: str) -> ServingContext:
        """The context that serves ``task`` for a request naming ``name`` (None: the first that serves it). 404
        for an unknown name, 400 naming ``model`` for a model of another task."""
        if name is not None:
            ctx = self.contexts.get(name)
            if ctx is None:
                raise APIError(404, f"The model `{name}` does not exist; this server serves "
                               f"{', '.join(f'`{n}`' for n in self.contexts)}.", "model", "model_not_found")
        else:
            ctx = next((c for c in self.contexts.values() if c.task == task), next(iter(self.contexts.values())))
        if ctx.task != task:
            raise bad_request(f"model: `{ctx.model_name}` is a {TASK_WORDS[ctx.task]} model; it does not serve "
                              f"{TASK_WORDS[task]}", "model")
        return ctx
