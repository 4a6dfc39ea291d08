"""Running the app under uvicorn: a graceful shutdown that ends in-flight requests with a finish reason, an exit
when the engine dies, and time limits for idle or trickling connections."""

from __future__ import annotations

import asyncio
import logging

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from conveyor.server.limits import DEFAULT_TIMEOUT_KEEP_ALIVE_S

logger = logging.getLogger("conveyor.server")

# After the engine died, how long open responses may take to go out before uvicorn cancels them: every stream
# already has its error, so this only covers clients that read slowly.
ENGINE_DEAD_GRACE_S = 3.0
# uvicorn's own graceful-shutdown timeout is the drain's deadline plus this: time for the aborted requests'
# final events and data: [DONE] to go out before uvicorn closes the connections.
SHUTDOWN_FLUSH_S = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn, plus:

    - the first SIGINT/SIGTERM also starts draining the engine (no new requests; in-flight ones get
      ``app.state.shutdown_timeout_s``, then are aborted), so a request still running at the deadline ends with
      finish_reason "abort" and ``data: [DONE]`` instead of a cut connection. A second SIGINT forces exit;
    - when the engine dies (its thread or its process), the server shuts down at once (every in-flight request
      has its error by then) and ``engine_died`` is set, so ``conveyor serve`` exits with status 1 and a
      supervisor restarts it, as vLLM does. A dead engine never serves again: staying up would only answer 503
      forever.
    """

    def __init__(self, config: uvicorn.Config, exit_on_engine_death: bool = True) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Future | None = None
        self.engine_died = False
        if exit_on_engine_death:
            config.app.state.async_engine.on_dead.append(self._on_engine_dead)

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        app: FastAPI = self.config.app
        if not self.should_exit and self._loop is not None:
            timeout = app.state.shutdown_timeout_s
            logger.info("shutting down: refusing new requests; in-flight ones get %.0f s to finish", timeout)
            engine = app.state.async_engine
            self._loop.call_soon_threadsafe(self._start_drain, engine, timeout)
        super().handle_exit(sig, frame)

    def _start_drain(self, engine, timeout: float) -> None:
        # The loop holds tasks only weakly: without this reference the drain could be collected mid-wait, and its
        # deadline's aborts would never come (the streams then hang until uvicorn's own timeout cuts them).
        self._drain_task = asyncio.ensure_future(engine.drain(timeout))

    def _on_engine_dead(self, exc: BaseException) -> None:  # on the event loop
        logger.critical("the engine died (%r): shutting the server down with exit status 1", exc)
        self.engine_died = True
        self.config.timeout_graceful_shutdown = ENGINE_DEAD_GRACE_S
        self.should_exit = True


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, plus a deadline for a request's headers: a connection that has not sent a whole
    request head within ``timeout_s`` of opening, or of the first byte of a later request, is closed. uvicorn's
    own ``timeout_keep_alive`` ends only silent connections, and only after a first response; one byte at a time
    (slowloris) would hold a connection forever.

    Between a response and the next request's first byte the connection is idle and only ``timeout_keep_alive``
    closes it: a deadline armed at the response would close idle keep-alive connections after ``timeout_s``,
    whatever the keep-alive, and a client that sends on a connection the server is closing gets nothing back."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            awaiting_head = self.conn.their_state is h11.IDLE
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request head is in: the rest is the app's business
                self._disarm_header_timer()
            elif awaiting_head and self._header_timer is None and not self.transport.is_closing():
                self._arm_header_timer()  # a later request's first bytes: its head must come in time too

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11Protocol


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info", timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                timeout_headers: float = 10.0, exit_on_engine_death: bool = True,
                loop: str = "auto") -> GracefulServer:
    """A uvicorn server for ``app``; ``.run()`` blocks (signal handling only in the main thread).

    ``timeout_keep_alive``: seconds an idle keep-alive connection stays open after a response (uvicorn's);
    ``timeout_headers``: seconds a client has to send a request's headers (see ``header_timeout_protocol``);
    ``loop``: uvicorn's event loop, ``auto`` (uvloop when installed, as users get it), ``uvloop`` or ``asyncio``.
    """
    timeout = app.state.shutdown_timeout_s
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=timeout_keep_alive,
                            timeout_graceful_shutdown=timeout + SHUTDOWN_FLUSH_S, http=header_timeout_protocol(timeout_headers),
                            loop=loop)
    return GracefulServer(config, exit_on_engine_death)
