"""The Batch API's settings (``conveyor serve``'s ``--data-dir`` and ``--batch-*`` flags) and its installation on
an app: the store, the runner over the app's own endpoint handlers, and the routes."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from fastapi import FastAPI

from conveyor.core.config import resolve_scheduling_policy
from conveyor.core.policies import BATCH_PRIORITY
from conveyor.engine.args import EngineArgs
from conveyor.server.batches.internal import Routes, internal_dispatch
from conveyor.server.batches.routes import install_batch_routes
from conveyor.server.batches.runner import BatchRunner
from conveyor.server.batches.store import BatchStore, StoreInUseError, StoreLimits, default_data_dir

logger = logging.getLogger("conveyor.server")


@dataclass(frozen=True)
class BatchAPIConfig:
    """Where the Batch API keeps its jobs and files, its bounds, how many lines run at once, and the priority they
    run at (None: the scheduling policy has no priorities, ``--scheduling-policy fcfs``: lines queue as any
    request)."""

    data_dir: str = field(default_factory=default_data_dir)
    limits: StoreLimits = field(default_factory=StoreLimits)
    concurrency: int = 64
    priority: int | None = None

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, args: EngineArgs) -> BatchAPIConfig:
        """From ``conveyor serve``'s flags; the lines run at the lowest priority unless the engine serves in
        arrival order (``--scheduling-policy fcfs``)."""
        limits = StoreLimits(ns.batch_max_files, ns.batch_max_bytes, ns.batch_max_file_bytes, ns.batch_max_lines,
                             ns.batch_max_jobs)
        ordered = resolve_scheduling_policy(args.policy, args.scheduling_policy) == "priority"
        return cls(ns.data_dir, limits, ns.batch_concurrency, BATCH_PRIORITY if ordered else None)


def add_batch_args(p: argparse.ArgumentParser) -> None:
    """``--data-dir`` and the Batch API's bounds."""
    d = StoreLimits()
    g = p.add_argument_group("Batch API (/v1/files, /v1/batches)")
    g.add_argument("--data-dir", default=default_data_dir(), metavar="DIR",
                   help="where batch jobs and files are kept (SQLite and a files directory), so that a restart finds "
                   f"them (default: {default_data_dir()})")
    g.add_argument("--batch-concurrency", type=int, default=64,
                   help="batch lines in flight at once (they run at the lowest priority: interactive requests go "
                   "first)")
    g.add_argument("--batch-max-files", type=int, default=d.max_files, help="files kept at most")
    g.add_argument("--batch-max-bytes", type=int, default=d.max_bytes, help="bytes of files kept at most")
    g.add_argument("--batch-max-file-bytes", type=int, default=d.max_file_bytes, help="the largest file accepted")
    g.add_argument("--batch-max-lines", type=int, default=d.max_lines, help="requests per batch at most")
    g.add_argument("--batch-max-jobs", type=int, default=d.max_jobs,
                   help="batch jobs kept at most (finished ones are forgotten oldest first)")


def install_batch_api(app: FastAPI, config: BatchAPIConfig, routes: Routes) -> BatchRunner | None:
    """The store under ``config.data_dir``, a runner sending lines through ``routes`` (url -> body model and
    handler, the app's own), and the routes; the runner is started and stopped by the app's lifespan. None, with a
    warning, when another server holds the directory (this one then serves no Batch API)."""
    try:
        store = BatchStore(config.data_dir, config.limits)
    except StoreInUseError as exc:
        logger.warning("the Batch API is off in this server: %s; give each server its own --data-dir", exc)
        return None
    priority = config.priority

    def lowest_priority(handler):
        async def run(body, raw):
            if priority is not None:
                body.priority = priority
            return await handler(body, raw)
        return run

    dispatch = internal_dispatch({url: (model, lowest_priority(handler)) for url, (model, handler) in routes.items()})
    runner = BatchRunner(store, dispatch, config.concurrency)
    install_batch_routes(app, store, runner)
    app.state.batch_store = store
    return runner
