"""Models on demand: a ``ModelRouter`` that loads the model a request names, each in an engine of its own, and
unloads it when it has been idle for its keep-alive or when ``max_loaded`` or the memory budget needs room (least
recently used first, never one in use), as Ollama's scheduler does.

A model is in use from the moment a request resolves it until that request's HTTP response has ended (a lease,
taken in ``resolve`` and given back by ``ModelLeaseMiddleware``), and while its engine has requests in flight.
Requests for a model that is loading wait for that one load, up to ``load_timeout_s`` (then 503); a load that
fails gives each of them the reason (500 ``model_load_failed``) and leaves the other models serving; the next
request for the model tries again. Unloading drains the model's engine and ends its process, so its memory goes
back to the system.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.engine.engine_client import ServedEngine
from conveyor.server.errors import APIError
from conveyor.server.model_memory import GIB, MemoryBudget
from conveyor.server.model_catalog import ModelCatalog
from conveyor.server.served_models import ModelEntry, check_task, not_found
from conveyor.server.serving_common import ServingContext

logger = logging.getLogger("conveyor.server")

DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's five minutes
REAP_INTERVAL_S = 0.5  # how often idle models are checked against their keep-alive
SHUTDOWN_LOAD_WAIT_S = 10.0  # at shutdown, how long loads under way may take to end (their engines then stop)
UNLOAD_DRAIN_S = 5.0  # an idle model has nothing in flight; the bound covers a request that just slipped in

# The leases the current HTTP request holds (set by ModelLeaseMiddleware; None outside a request, e.g. a batch
# line, which is then protected by its engine's in-flight count alone).
_LEASES: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar("conveyor_model_leases",
                                                                                         default=None)


class ModelLeaseMiddleware:
    """Gives back the models an HTTP request used once its response has ended (a stream: its last byte)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        leases: list[Callable[[], None]] = []
        token = _LEASES.set(leases)
        try:
            await self.app(scope, receive, send)
        finally:
            _LEASES.reset(token)
            for release in leases:
                release()


class ModelLoadError(RuntimeError):
    """A model could not be loaded (the reason from its engine, or no room in time)."""


@dataclass(eq=False)
class _Loaded:
    name: str
    engine: ServedEngine
    ctx: ServingContext
    keep_alive_s: float
    last_used: float = field(default_factory=time.monotonic)
    leases: int = 0
    bytes: int = 0  # its charge against the memory budget (model_memory.py)

    @property
    def busy(self) -> bool:
        return self.leases > 0 or self.engine.num_in_flight > 0

    def idle_until(self) -> float | None:
        """When (monotonic) this model's keep-alive runs out, counted from its last use; None: never."""
        return None if self.keep_alive_s < 0 else self.last_used + self.keep_alive_s


StartEngine = Callable[[str, str], ServedEngine]  # (name, path) -> a ready engine; blocking, run on a thread


class ModelPool:
    """A ``ModelRouter`` over ``catalog``'s models, loaded on demand.

    ``start_engine(name, path)`` builds a model's engine and waits until it is ready (on a worker thread; it
    raises what refused the model); ``make_context(engine, name)`` wraps a started engine for the routes.
    ``keep_alive_s``: how long an idle model stays loaded by default (negative: for good); ``max_loaded``: the
    most models loaded at once (None: no bound); ``load_timeout_s``: how long a request waits for its model to
    load (including waiting for room); ``memory``: the budget in bytes of the loaded models (None: no bound; a
    model larger than the whole budget loads alone). ``start()`` on the event loop; ``drain`` / ``shutdown`` at
    the end."""

    def __init__(self, catalog: ModelCatalog, start_engine: StartEngine,
                 make_context: Callable[[ServedEngine, str], ServingContext],
                 keep_alive_s: float = DEFAULT_KEEP_ALIVE_S, max_loaded: int | None = None,
                 load_timeout_s: float = 600.0, memory: MemoryBudget | None = None) -> None:
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded}")
        self.catalog, self.start_engine, self.make_context = catalog, start_engine, make_context
        self.keep_alive_s, self.max_loaded, self.load_timeout_s = keep_alive_s, max_loaded, load_timeout_s
        self.memory = memory
        self.loaded: dict[str, _Loaded] = {}
        self.loading: dict[str, asyncio.Future] = {}
        self.failed: dict[str, str] = {}  # name -> why its last load failed
        self.counts = {"loads": {}, "load_failures": {}, "unloads": {}}  # name (, reason) -> count, for /metrics
        self._reserved = 0  # loads that made room and have not finished
        self._reserved_bytes = 0  # what those loads are expected to hold
        self._waiting: dict[str, int] = {}  # name -> requests waiting for its load
        self._changed = asyncio.Event()
        self._closing = False
        self._reaper: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.on_dead: list[Callable[[BaseException], None]] = []  # (never called: one model's death is not fatal)

    # ---- ModelRouter ------------------------------------------------------------------------------------
    async def resolve(self, name: str | None, task: str | None,
                      keep_alive_s: float | None = None) -> ServingContext:
        name = self.catalog.names[0] if name is None else name
        if self.catalog.path_of(name) is None:
            raise not_found(name, self.catalog.names)
        deadline = time.monotonic() + self.load_timeout_s
        while True:
            if self._closing:
                raise APIError(503, "the server is shutting down and accepts no new requests",
                               code="server_shutting_down")
            entry = self.loaded.get(name)
            if entry is not None:
                if entry.engine.is_running:
                    return check_task(self._lease(entry, keep_alive_s), task)
                await self._unload(entry, "engine died")
            load = self.loading.get(name)
            if load is None:
                load = self.loading[name] = asyncio.ensure_future(self._load(name, deadline))
            # Counted as the model's users from now on: a model just loaded is not idle before its waiters, who
            # resume a loop turn or two later, have taken their leases (else a load waiting for room takes it back
            # at once, and two models thrash under --max-loaded-models 1).
            self._waiting[name] = self._waiting.get(name, 0) + 1
            try:
                await asyncio.wait_for(asyncio.shield(load), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise APIError(503, f"model `{name}` did not load within {self.load_timeout_s:.0f} s; try again",
                               code="model_loading", headers={"Retry-After": "5"}) from None
            except ModelLoadError as exc:
                raise APIError(500, f"model `{name}` could not be loaded: {exc}", "model",
                               "model_load_failed") from None
            finally:
                self._waiting[name] -= 1
                if not self._waiting[name]:
                    del self._waiting[name]

    def entries(self) -> list[ModelEntry]:
        self.catalog.refresh()
        out = []
        for name in self.catalog.names:
            entry = self.loaded.get(name)
            if entry is not None:
                out.append(ModelEntry(name, "loaded", entry.ctx, self.catalog.paths[name],
                                      self._expires_at(entry), entry.engine.num_in_flight))
            else:
                state = "loading" if name in self.loading else "failed" if name in self.failed else "unloaded"
                out.append(ModelEntry(name, state, path=self.catalog.paths[name]))
        return out

    def _expires_at(self, entry: _Loaded) -> float | None:
        until = entry.idle_until()
        if until is None:
            return None
        left = entry.keep_alive_s if entry.busy else max(until - time.monotonic(), 0.0)
        return time.time() + left

    def _lease(self, entry: _Loaded, keep_alive_s: float | None) -> ServingContext:
        entry.last_used = time.monotonic()
        if keep_alive_s is not None:  # the newest request's keep-alive wins, as in Ollama
            entry.keep_alive_s = keep_alive_s
        holder = _LEASES.get()
        if holder is not None:
            entry.leases += 1
            holder.append(lambda: self._release(entry))
        return entry.ctx

    def _release(self, entry: _Loaded) -> None:
        entry.leases -= 1
        entry.last_used = time.monotonic()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- loading and unloading --------------------------------------------------------------------------
    async def _load(self, name: str, deadline: float) -> None:
        """Load ``name`` (making room first); raise ModelLoadError with the reason if it cannot be."""
        path = self.catalog.paths[name]
        expected = self.memory.expected(name, path) if self.memory is not None else 0
        try:
            await self._make_room(name, expected, deadline)
            try:
                started = time.monotonic()
                engine = await asyncio.to_thread(self.start_engine, name, path)
            finally:
                self._reserved -= 1
                self._reserved_bytes -= expected
            if self._closing:
                await engine.shutdown()
                raise ModelLoadError("the server is shutting down")
            engine.start()
            entry = _Loaded(name, engine, self.make_context(engine, name), self.keep_alive_s)
            if self.memory is not None:
                entry.bytes = self.memory.loaded(name, engine.info.pid)
            engine.on_dead.append(lambda exc: self._on_engine_dead(entry, exc))
            self.loaded[name] = entry
            self.failed.pop(name, None)
            _bump(self.counts["loads"], name)
            logger.info("model %s loaded in %.2f s (engine process %s, %.2f GiB resident); %d loaded", name,
                        time.monotonic() - started, engine.info.pid, entry.bytes / GIB, len(self.loaded))
            self._spawn(self._settle(entry))  # its waiters need not wait for the unloads it may start
        except ModelLoadError as exc:
            self._failed(name, str(exc))
            raise
        except Exception as exc:  # noqa: BLE001 - whatever refused the model is its waiters' answer
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self._failed(name, why)
            raise ModelLoadError(why) from exc
        finally:
            self.loading.pop(name, None)
            self._notify()

    def _failed(self, name: str, why: str) -> None:
        logger.error("model %s could not be loaded: %s", name, why)
        self.failed[name] = why
        _bump(self.counts["load_failures"], name)

    def _fits(self, expected: int) -> bool:
        """One more model, expected to hold ``expected`` bytes, fits beside the loaded ones and the loads under
        way: under ``max_loaded``, and under the memory budget (or it would be the only one)."""
        if self.max_loaded is not None and len(self.loaded) + self._reserved >= self.max_loaded:
            return False
        if self.memory is None or (not self.loaded and not self._reserved):
            return True
        held = sum(e.bytes for e in self.loaded.values()) + self._reserved_bytes
        return held + expected <= self.memory.limit_bytes

    async def _make_room(self, name: str, expected: int, deadline: float) -> None:
        """Wait until one more model fits (``_fits``), unloading idle models, least recently used first; reserve
        its place."""
        while not self._fits(expected):
            idle = [e for e in self.loaded.values() if self._idle(e)]
            if idle:
                victim = min(idle, key=lambda e: e.last_used)
                self._reserved += 1  # held while the victim unloads, so no other load takes the room it frees
                self._reserved_bytes += expected
                try:
                    await self._unload(victim, f"room for {name}")
                finally:
                    self._reserved -= 1
                    self._reserved_bytes -= expected
                continue
            changed = self._changed
            left = deadline - time.monotonic()
            if left <= 0:
                raise ModelLoadError(f"no room: {self._room_text()} and each is in use")
            try:
                await asyncio.wait_for(changed.wait(), left)
            except asyncio.TimeoutError:
                pass
        self._reserved += 1
        self._reserved_bytes += expected

    def _room_text(self) -> str:
        text = f"{len(self.loaded)} models are loaded"
        if self.max_loaded is not None:
            text += f" (--max-loaded-models {self.max_loaded})"
        if self.memory is not None:
            held = sum(e.bytes for e in self.loaded.values())
            text += f", holding {held / GIB:.2f} GiB (--max-loaded-memory {self.memory.limit_bytes / GIB:g})"
        return text

    async def _settle(self, new: _Loaded) -> None:
        """After ``new`` loaded and was measured (in the background, so its requests start at once): while the loaded models hold more than the budget (its first
        load's estimate was low), unload idle ones, least recently used first (never ``new``)."""
        if self.memory is None:
            return
        while sum(e.bytes for e in self.loaded.values()) + self._reserved_bytes > self.memory.limit_bytes:
            idle = [e for e in self.loaded.values() if e is not new and self._idle(e)]
            if not idle:
                return  # the others are in use: they unload when idle and room is needed again
            await self._unload(min(idle, key=lambda e: e.last_used), f"room for {new.name}")

    async def _unload(self, entry: _Loaded, reason: str) -> None:
        """Take ``entry`` out of service now and end its engine (and its process)."""
        if self.loaded.get(entry.name) is not entry:
            return
        del self.loaded[entry.name]
        _bump(self.counts["unloads"], (entry.name, reason.split()[0]))
        logger.info("unloading model %s (%s)", entry.name, reason)
        try:
            await entry.engine.drain(UNLOAD_DRAIN_S)
            await entry.engine.shutdown()
        finally:
            self._notify()

    def _idle(self, entry: _Loaded) -> bool:
        """Nothing uses ``entry`` and no request is about to (it may be unloaded)."""
        return not entry.busy and not self._waiting.get(entry.name)

    def _on_engine_dead(self, entry: _Loaded, exc: BaseException) -> None:
        """One model's engine died (its requests have their errors): the next request loads it again."""
        if self.loaded.get(entry.name) is entry:
            logger.error("model %s: its engine died (%r); it loads again on its next request", entry.name, exc)
            self._spawn(self._unload(entry, "engine died"))

    def _spawn(self, work) -> None:
        """Run ``work`` (a coroutine) in the background, logging a failure."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)  # (the loop holds tasks weakly)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("model pool background work failed", exc_info=task.exception())

    async def unload_idle(self) -> None:
        """Unload every model whose keep-alive has run out since its last use (and that nothing uses)."""
        now = time.monotonic()
        for entry in list(self.loaded.values()):
            until = entry.idle_until()
            if until is not None and until <= now and self._idle(entry):
                await self._unload(entry, "idle")

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            try:
                await self.unload_idle()
            except Exception:  # noqa: BLE001 - one failed unload must not stop the others'
                logger.exception("unloading an idle model failed")

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._changed = asyncio.Event()
        self._reaper = asyncio.ensure_future(self._reap_forever())

    def stop_admissions(self) -> None:
        self._closing = True

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; let each loaded model's requests finish for up to ``timeout_s``."""
        self._closing = True
        await asyncio.gather(*(e.engine.drain(timeout_s) for e in list(self.loaded.values())))

    async def shutdown(self) -> None:
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
        if self.loading:  # a load ends its engine itself once it sees the server closing (a daemon process)
            await asyncio.wait(list(self.loading.values()), timeout=SHUTDOWN_LOAD_WAIT_S)
        await asyncio.gather(*(e.engine.shutdown() for e in list(self.loaded.values())), return_exceptions=True)
        self.loaded.clear()


def _bump(counts: dict, key) -> None:
    counts[key] = counts.get(key, 0) + 1
