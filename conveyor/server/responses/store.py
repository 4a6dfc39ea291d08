"""Past responses of the Responses API (``store: true``), for ``GET``/``DELETE /v1/responses/{id}`` and
``previous_response_id``: a table in SQLite, so they survive a restart, bounded in rows and in bytes (the oldest
are evicted first), and scoped by API key: a response is found only with the key that stored it (a digest of the
key is stored, never the key).

Each row holds the response as the client saw it, the input items of its request, and its conversation (the
messages a follow-up request continues from, in the chat path's form). SQLite calls block: the handlers make them
on a worker thread (``asyncio.to_thread``); one connection, behind a lock.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger("conveyor.server")

DEFAULT_MAX_ROWS = 10_000
DEFAULT_MAX_BYTES = 256 * 2**20
BUSY_TIMEOUT_S = 10.0  # how long a write waits for another server writing the same file


def default_path() -> str:
    """Where ``conveyor serve`` keeps past responses by default: the user's state directory (XDG)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "conveyor", "responses.sqlite3")


def add_store_args(p: argparse.ArgumentParser) -> None:
    """``--responses-store``, ``--responses-max-rows``, ``--responses-max-bytes``."""
    g = p.add_argument_group("Responses API store (previous_response_id, GET /v1/responses/{id})")
    g.add_argument("--responses-store", default=default_path(), metavar="PATH",
                   help="the SQLite file past responses are kept in, so they survive a restart (default: "
                   f"{default_path()}; :memory: keeps them in memory only)")
    g.add_argument("--responses-max-rows", type=int, default=DEFAULT_MAX_ROWS,
                   help=f"the most responses kept; the oldest are evicted first (default {DEFAULT_MAX_ROWS})")
    g.add_argument("--responses-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help=f"the most bytes of responses kept (default {DEFAULT_MAX_BYTES // 2**20} MiB)")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    scope TEXT NOT NULL,
    created REAL NOT NULL,
    bytes INTEGER NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    conversation TEXT NOT NULL
)"""


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    input_items: list
    conversation: list  # chat messages: the prompt a follow-up continues, this response's output included


class ResponseStore:
    """Bounded, key-scoped storage of past responses. ``path``: an SQLite file (created with its directory), or
    ``":memory:"`` (gone with the process). At most ``max_rows`` responses and ``max_bytes`` bytes of their
    JSON are kept; a response larger than ``max_bytes`` alone is not stored."""

    def __init__(self, path: str = ":memory:", max_rows: int = DEFAULT_MAX_ROWS,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_rows < 1 or max_bytes < 1:
            raise ValueError(f"the responses store needs max_rows and max_bytes >= 1, got {max_rows}, {max_bytes}")
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path, self.max_rows, self.max_bytes = path, max_rows, max_bytes
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None)
        if path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ResponseStore:
        return cls(ns.responses_store, ns.responses_max_rows, ns.responses_max_bytes)

    def put(self, scope: str, response: dict, input_items: list, conversation: list) -> bool:
        """Store a response under ``scope``; evicts the oldest rows to stay within bounds. False when the response
        alone is over the byte bound (it is not stored)."""
        texts = [json.dumps(v, ensure_ascii=False, separators=(",", ":"))
                 for v in (response, input_items, conversation)]
        size = sum(len(t.encode("utf-8")) for t in texts)
        if size > self.max_bytes:
            logger.warning("response %s not stored: %d bytes, over the store's bound of %d (--responses-max-bytes)",
                           response["id"], size, self.max_bytes)
            return False
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO responses (id, scope, created, bytes, response, input_items,"
                                 " conversation) VALUES (?, ?, ?, ?, ?, ?, ?)",
                                 (response["id"], scope, time.time(), size, *texts))
                self._evict()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return True

    def _evict(self) -> None:
        rows, total = self._db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM responses").fetchone()
        while rows > self.max_rows or total > self.max_bytes:
            seq, size = self._db.execute("SELECT seq, bytes FROM responses ORDER BY seq LIMIT 1").fetchone()
            self._db.execute("DELETE FROM responses WHERE seq = ?", (seq,))
            rows, total = rows - 1, total - size

    def get(self, scope: str, response_id: str) -> StoredResponse | None:
        """The response ``response_id`` stored under ``scope`` (None: none, or another key's)."""
        with self._lock:
            row = self._db.execute("SELECT response, input_items, conversation FROM responses WHERE id = ? AND "
                                   "scope = ?", (response_id, scope)).fetchone()
        return None if row is None else StoredResponse(*(json.loads(t) for t in row))

    def delete(self, scope: str, response_id: str) -> bool:
        with self._lock:
            deleted = self._db.execute("DELETE FROM responses WHERE id = ? AND scope = ?", (response_id, scope))
        return deleted.rowcount > 0

    def usage(self) -> tuple[int, int]:
        """(rows, bytes) stored now."""
        with self._lock:
            return self._db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM responses").fetchone()

    def close(self) -> None:
        with self._lock:
            self._db.close()
