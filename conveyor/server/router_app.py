"""The app of a server that loads models on demand (``conveyor serve --models-dir`` / ``--model NAME=PATH``): the
same routes as ``build_app``'s, each request's model looked up in a ``ModelPool``; ``/health`` and ``/metrics``
say which models are loaded."""

from __future__ import annotations

import contextlib
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from conveyor.server.app import PROMETHEUS_TYPE, install_middleware, install_routes
from conveyor.server.cors import CORSConfig
from conveyor.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from conveyor.server.model_pool import ModelLeaseMiddleware, ModelPool
from conveyor.server.responses.store import ResponseStore

P = "conveyor:"


class PoolCollector:
    """The pool's state at scrape time: which models are loaded, their engines' queues, loads and unloads."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def collect(self):
        entries = self.pool.entries()
        loaded = GaugeMetricFamily(P + "model_loaded", "1 while the model is loaded (0: not loaded).",
                                   labels=["model_name"])
        running = GaugeMetricFamily(P + "num_requests_running", "Requests in the running batch.",
                                    labels=["model_name"])
        waiting = GaugeMetricFamily(P + "num_requests_waiting", "Requests waiting to be scheduled.",
                                    labels=["model_name"])
        kv = GaugeMetricFamily(P + "kv_cache_usage_perc", "KV-cache usage (1 = full).", labels=["model_name"])
        for each in entries:
            loaded.add_metric([each.name], 1.0 if each.state == "loaded" else 0.0)
            if each.ctx is not None:
                stats = each.ctx.engine.stats
                running.add_metric([each.name], stats.num_running)
                waiting.add_metric([each.name], stats.num_waiting)
                kv.add_metric([each.name], stats.kv_cache_usage)
        yield from (loaded, running, waiting, kv)
        counts = self.pool.counts
        for key, doc in (("loads", "Models loaded."), ("load_failures", "Model loads that failed.")):
            family = CounterMetricFamily(P + "model_" + key, doc, labels=["model_name"])
            for name, n in counts[key].items():
                family.add_metric([name], n)
            yield family
        unloads = CounterMetricFamily(P + "model_unloads", "Models unloaded, by reason (idle, room, engine).",
                                      labels=["model_name", "reason"])
        for (name, reason), n in counts["unloads"].items():
            unloads.add_metric([name, reason], n)
        yield unloads


def build_router_app(pool: ModelPool, api_key: str | list[str] | None = None, shutdown_timeout_s: float = 30.0,
                     max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, cors: CORSConfig | None = None,
                     responses_store: ResponseStore | None = None) -> FastAPI:
    """An OpenAI-, Anthropic- and Ollama-compatible app serving ``pool``'s models, each loaded when a request
    first names it (its engine in a process of its own) and unloaded when idle (``model_pool.py``)."""
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        pool.start()
        try:
            yield
        finally:
            await pool.drain(shutdown_timeout_s)
            await pool.shutdown()

    app = FastAPI(title="conveyor", lifespan=lifespan)
    app.state.async_engine = pool  # what a graceful shutdown drains (launcher.py)
    app.state.shutdown_timeout_s = shutdown_timeout_s
    app.add_middleware(ModelLeaseMiddleware)  # innermost: a lease ends with its response
    install_middleware(app, api_key, max_request_body_bytes, cors)
    install_routes(app, pool, responses_store, int(time.time()), with_state=True)

    @app.get("/health")
    async def health():
        """200 while the server serves (a model not loaded loads on its next request), with each model's state."""
        return JSONResponse({"status": "ok", "models": {e.name: e.state for e in pool.entries()}})

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(registry), media_type=PROMETHEUS_TYPE)

    return app
