"""Running the app under uvicorn, with a graceful shutdown that ends in-flight requests with a finish reason."""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger("conveyor.server")


class GracefulServer(uvicorn.Server):
    """uvicorn, plus: the first SIGINT/SIGTERM also starts draining the engine (no new requests; in-flight ones
    get ``app.state.shutdown_timeout_s``, then are aborted), so a request still running at the deadline ends
    with finish_reason "abort" and ``data: [DONE]`` instead of a cut connection. A second SIGINT forces exit."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        app: FastAPI = self.config.app
        if not self.should_exit and self._loop is not None:
            timeout = app.state.shutdown_timeout_s
            logger.info("shutting down: refusing new requests; in-flight ones get %.0f s to finish", timeout)
            engine = app.state.async_engine
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(engine.drain(timeout)))
        super().handle_exit(sig, frame)


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> GracefulServer:
    """A uvicorn server for ``app``; ``.run()`` blocks (signal handling only in the main thread)."""
    timeout = app.state.shutdown_timeout_s
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=5,
                            timeout_graceful_shutdown=timeout + 5.0)
    return GracefulServer(config)
