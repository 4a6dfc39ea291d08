"""The FastAPI app: routes, API-key check, and the lifespan that runs the engine.

``build_app(engine)`` takes an engine that is already loaded, so model errors surface before the port opens:
any ``ServedEngine`` (``engine_client.py``), or an ``LLMEngine``, which it steps in a thread (``AsyncEngine``).
The routes stay thin; the work is in ``serving_*.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from conveyor.engine.async_engine import serving_engine
from conveyor.engine.engine_client import ServedEngine, picklable
from conveyor.server.anthropic.messages import install_anthropic_routes
from conveyor.server.admission import ServiceClasses, make_admission
from conveyor.server.auth import APIKeyMiddleware
from conveyor.server.batches.setup import BatchAPIConfig, install_batch_api
from conveyor.server.body_limit import BodyLimitMiddleware
from conveyor.server.cors import CORSConfig, install_cors
from conveyor.server.errors import APIError, install_error_handlers
from conveyor.server.limits import (
    DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_SEQS_PER_REQUEST, UPLOAD_OVERHEAD_BYTES, max_token_chars,
)
from conveyor.server.metrics import ServerMetrics, log_stats_forever
from conveyor.server.ollama.embed import install_ollama_embed_routes
from conveyor.server.ollama.routes import install_ollama_routes
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.server.responses.serving import install_responses_routes
from conveyor.server.responses.store import ResponseStore
from conveyor.server.lora_adapters import LoRAAdapters, install_lora_routes
from conveyor.server.served_models import ModelEntry, ModelRouter, ServedModels, not_found
from conveyor.server.serving_chat import create_chat_completion
from conveyor.server.serving_common import ServingContext
from conveyor.server.serving_completion import create_completion
from conveyor.server.serving_pooling import install_pooling_routes
from conveyor.server.tokenizer_routes import install_tokenizer_routes
from conveyor.structured.checker import CHECK_TIMEOUT_S, GrammarChecker

if TYPE_CHECKING:  # annotations only: serve's API process runs its engine elsewhere and never imports torch
    from conveyor.engine.llm_engine import LLMEngine


def build_app(engine: ServedEngine | LLMEngine, served_model_name: str | None = None,
              api_key: str | list[str] | None = None,
              log_stats_interval_s: float = 5.0, shutdown_timeout_s: float = 30.0, max_n: int = 128,
              metrics: ServerMetrics | None = None, health_detail: Callable[[], dict] | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST, cors: CORSConfig | None = None,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None,
              responses_store: ResponseStore | None = None,
              also_serve: list[tuple[ServedEngine | LLMEngine, str | None]] = (),
              grammar_check_timeout_s: float = CHECK_TIMEOUT_S, batches: BatchAPIConfig | None = None,
              service_classes: ServiceClasses | None = None, lora_modules: list[tuple[str, str]] = ()) -> FastAPI:
    """An OpenAI-compatible app serving ``engine``'s model: a ``ServedEngine`` (``EngineCoreClient``, the engine
    in its own process; ``AsyncEngine``; ``distributed.ReplicaPool``), or an ``LLMEngine``, stepped in a thread of
    this process (``AsyncEngine``). The engine runs for the app's lifespan. ``max_n`` bounds ``n`` (and
    ``best_of``) per request: 128, as OpenAI's API does; ``max_seqs_per_request`` bounds prompts x n; a body over
    ``max_request_body_bytes`` is 413 (``body_limit.py``). ``cors``: what browsers on other origins may do
    (``cors.py``; None: vLLM's defaults, anything without credentials). A constraint whose check (compile and first
    tokens, in a worker process: ``structured.checker``) takes longer than ``grammar_check_timeout_s`` is 400.

    ``api_key``: one key or several, any of which a request may present. ``tool_call_parser`` and
    ``reasoning_parser``: the model's tool-call and reasoning syntaxes (None: read from its chat template).
    ``responses_store``: where the Responses API keeps past responses (None: in memory, bounded, gone with the
    process; ``conveyor serve`` passes an SQLite file).

    ``metrics`` replaces the app's own ``ServerMetrics`` (scale-out passes one that merges its replicas'), and
    ``health_detail``, when given, is what ``/health`` answers with.

    ``also_serve``: more (engine, served name or None) pairs, each model in its own engine behind this one app
    (``conveyor serve --embedding-model``); a request goes to the model its ``model`` field names, else to the
    first that serves its endpoint's task (``served_models.ServedModels``). Metrics and the tokenizer and
    Anthropic routes are the first engine's.

    ``batches``: serve the Batch API (``/v1/files``, ``/v1/batches``) with this store and runner configuration
    (None: not served); its lines go through this app's own completion, chat and embedding handlers.

    ``service_classes``: SLO-aware admission for the first engine's requests (``admission.py``; None: every
    request is admitted).

    An engine started with ``enable_lora`` serves LoRA adapters of its model by name (``lora_adapters.py``):
    ``lora_modules`` (name, path) at once (ValueError naming a refused one), more through
    ``/v1/load_lora_adapter``."""
    if max_request_body_bytes < 1 or max_seqs_per_request < 1:
        raise ValueError(f"max_request_body_bytes and max_seqs_per_request must be >= 1, got "
                         f"{max_request_body_bytes} and {max_seqs_per_request}")
    engine = serving_engine(engine)
    info = engine.info  # (the engine core process: waits until it is ready)
    model_name = served_model_name or info.model_info.name
    if metrics is None:
        metrics = ServerMetrics(engine, model_name)
        metrics.attach()
    tokenizer = info.tokenizer
    # The checker's workers get the tokenizer itself when it pickles (one sent with the engine's "ready" does),
    # else the model to load it from.
    checker = GrammarChecker(tokenizer if picklable(tokenizer) else info.args.model, info.model_info.vocab_size,
                             grammar_check_timeout_s)
    ctx = ServingContext(engine, model_name, max_n, max_seqs_per_request, max_token_chars(tokenizer),
                         tool_call_parser, reasoning_parser, grammar_checker=checker)
    if service_classes is not None:
        ctx.admission = make_admission(service_classes, engine, metrics.registry)
    created = int(time.time())
    served = ServedModels()
    served.add(ctx)
    engines = [engine]
    for other, name in also_serve:
        other = serving_engine(other)
        engines.append(other)
        served.add(ServingContext(other, name or other.info.model_info.name, max_n, max_seqs_per_request,
                                  max_token_chars(other.info.tokenizer), tool_call_parser, reasoning_parser))

    router: ModelRouter = served
    if info.args.enable_lora:
        adapters = LoRAAdapters(served, ctx)
        for name, path in lora_modules:
            try:
                adapters.add(name, path)
            except APIError as exc:
                raise ValueError(f"--lora-modules {name}={path}: {exc.message}") from None
        router = adapters
    elif lora_modules:
        raise ValueError("--lora-modules needs --enable-lora")

    batch_runner = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for each in engines:
            each.start()
        logger_task = None
        if log_stats_interval_s > 0:
            logger_task = asyncio.create_task(log_stats_forever(metrics, log_stats_interval_s))
        if batch_runner is not None:
            batch_runner.start()
        try:
            yield
        finally:
            if logger_task is not None:
                logger_task.cancel()
            if batch_runner is not None:  # its lines in flight end without a result: they run at the next start
                await batch_runner.stop()
                batch_runner.store.close()
            await asyncio.gather(*(each.drain(shutdown_timeout_s) for each in engines))
            checker.close()
            for each in engines:
                await each.shutdown()

    app = FastAPI(title="conveyor", lifespan=lifespan)
    app.state.async_engine = engine
    app.state.metrics = metrics
    app.state.shutdown_timeout_s = shutdown_timeout_s
    # before anything reads the body; a batch input file may be larger than any request
    larger = {"/v1/files": (batches.limits.max_file_bytes + UPLOAD_OVERHEAD_BYTES, "--batch-max-file-bytes")} \
        if batches is not None else {}
    install_middleware(app, api_key, max_request_body_bytes, cors, larger)
    internal_routes = install_routes(app, router, responses_store, created)
    if isinstance(router, LoRAAdapters):
        install_lora_routes(app, router)
    if batches is not None:
        batch_runner = install_batch_api(app, batches, internal_routes)

    @app.get("/health")
    async def health():
        if not all(each.is_running for each in engines):
            return JSONResponse(APIError(503, "engine is not running", code="engine_dead").body(), 503)
        return JSONResponse(health_detail()) if health_detail else Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=PROMETHEUS_TYPE)

    return app


PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def install_middleware(app: FastAPI, api_key: str | list[str] | None, max_request_body_bytes: int,
                       cors: CORSConfig | None, larger: dict | None = None) -> None:
    """The API-key check, the body limit (``larger``: bigger limits by path) and CORS, in that order inwards."""
    install_error_handlers(app)
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes, larger=larger or {})
    install_cors(app, cors or CORSConfig())  # outermost: its headers go on the answers of the two above too


def model_card(entry: ModelEntry, created: int, with_state: bool = False) -> dict:
    """A model's entry in ``/v1/models``; ``with_state``: its load state too (llama.cpp's router mode), for a
    server that loads models on demand (an unloaded model's context length is not known yet)."""
    info = entry.ctx.engine.info if entry.ctx is not None else None
    card = {"id": entry.name, "object": "model", "created": created, "owned_by": "conveyor",
            "root": entry.path if entry.parent is not None or info is None else (info.args.model or info.model_info.name),
            "parent": entry.parent,
            "max_model_len": info.max_model_len if info is not None else None}
    if with_state:
        card["status"] = {"value": entry.state}
    return card


def install_routes(app: FastAPI, served: ModelRouter, responses_store: ResponseStore | None, created: int,
                   with_state: bool = False) -> dict:
    """Every protocol's model routes, each request's model looked up in ``served``; returns the internal routes
    the Batch API runs its lines through. ``with_state``: model listings show each model's load state."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        chosen = await served.resolve(body.model, "generate")
        return await create_completion(body, raw, chosen, chosen.engine.info.tokenizer)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        chosen = await served.resolve(body.model, "generate")
        return await create_chat_completion(body, raw, chosen, chosen.engine.info.tokenizer)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(each, created, with_state) for each in served.entries()]}

    # ":path": a served name may hold slashes ("org/model"); the openai client sends them %2F-encoded, and the
    # server decodes the path before routing.
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        entries = served.entries()
        for each in entries:
            if each.name == model_id:
                return model_card(each, created, with_state)
        raise not_found(model_id, [each.name for each in entries])

    @app.get("/version")
    async def version():
        from conveyor import __version__

        return {"version": __version__}

    install_tokenizer_routes(app, served)
    install_anthropic_routes(app, served)
    install_responses_routes(app, served, responses_store or ResponseStore())
    install_ollama_routes(app, served)
    install_ollama_embed_routes(app, served)
    return {"/v1/completions": (CompletionRequest, completions),
            "/v1/chat/completions": (ChatCompletionRequest, chat_completions),
            **install_pooling_routes(app, served)}
