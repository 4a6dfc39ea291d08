"""Batch jobs and their files, durable: metadata and every finished line's result in SQLite, file contents in a
files directory beside it, both under ``--data-dir``; bounded (files, bytes, jobs) and scoped by API key (a digest
of the key is stored, never the key).

Exactly once: a line's result is one row, inserted in one transaction when the line finishes (``record``); a job
that resumes after a restart runs only the lines without a row, and a second insert of the same line is ignored, so
no line has two results whatever happened between the insert and the crash. The output and error files are derived
from those rows when the job ends (``finalize``), written to a temporary name, synced and renamed before the job row
names them.

SQLite calls block: the async callers make them on a worker thread. One connection behind a lock.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass

logger = logging.getLogger("conveyor.server")

BUSY_TIMEOUT_S = 10.0
TERMINAL = ("completed", "failed", "expired", "cancelled")  # a job in these statuses never runs again
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS files (
        id TEXT PRIMARY KEY, scope TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
        bytes INTEGER NOT NULL, created_at INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS batches (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, scope TEXT NOT NULL,
        status TEXT NOT NULL, created_at INTEGER NOT NULL, total INTEGER NOT NULL, body TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS results (
        batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, record TEXT NOT NULL,
        PRIMARY KEY (batch_id, line))""",
)


@dataclass(frozen=True)
class StoreLimits:
    """What the store holds at most: files (uploaded and written), their bytes in all, one file's bytes, lines of
    one input file, and jobs (finished ones are forgotten oldest first to make room; active ones never are)."""

    max_files: int = 1000
    max_bytes: int = 10 * 2**30
    max_file_bytes: int = 200 * 2**20  # OpenAI's limit for a batch input file
    max_lines: int = 50_000  # OpenAI's limit of requests per batch
    max_jobs: int = 1000

    def __post_init__(self) -> None:
        for name in ("max_files", "max_bytes", "max_file_bytes", "max_lines", "max_jobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class StoreInUseError(RuntimeError):
    """Another server holds the data directory: two runners over one store would run each job twice."""


class StoreFullError(Exception):
    """The store is at one of its bounds; ``param`` names the flag that sets it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def default_data_dir() -> str:
    """Where ``conveyor serve`` keeps state by default: the user's state directory (XDG), so a restart by the same
    user finds its jobs."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "conveyor")


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class BatchStore:
    """Files and batch jobs under ``data_dir`` (``batches.sqlite3`` and ``files/``)."""

    def __init__(self, data_dir: str, limits: StoreLimits | None = None) -> None:
        self.limits = limits or StoreLimits()
        self.files_dir = os.path.join(data_dir, "files")
        os.makedirs(self.files_dir, exist_ok=True)
        self._owner = _hold_directory(data_dir)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(os.path.join(data_dir, "batches.sqlite3"), timeout=BUSY_TIMEOUT_S,
                                   check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a recorded line survives a power cut, not only a kill
        for statement in _SCHEMA:
            self._db.execute(statement)
        self._sweep()

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._owner.close()  # releases the directory's lock

    def _transaction(self):
        return _Transaction(self._db, self._lock)

    def _sweep(self) -> None:
        """Remove what a crash left behind: partial uploads, and contents no row names (a crash between the rename
        and the insert); a row whose contents are gone is dropped."""
        with self._transaction() as db:
            known = {row[0] for row in db.execute("SELECT id FROM files")}
            on_disk = set(os.listdir(self.files_dir))
            for name in on_disk - known:
                os.unlink(os.path.join(self.files_dir, name))
            for missing in known - on_disk:
                logger.warning("batch store: file %s has no contents on disk; forgotten", missing)
                db.execute("DELETE FROM files WHERE id = ?", (missing,))

    # ---- files ------------------------------------------------------------------------------------------
    def file_path(self, file_id: str) -> str:
        return os.path.join(self.files_dir, file_id)

    def temp_path(self) -> str:
        """Where an upload is written before ``add_file`` (swept at start-up if the server dies first)."""
        return os.path.join(self.files_dir, f".upload-{uuid.uuid4().hex}")

    def add_file(self, scope: str, temp_path: str, filename: str, purpose: str) -> dict:
        """Keep the contents written to ``temp_path`` as a new file; its OpenAI file object. StoreFullError at the
        files or bytes bound (the temporary file is removed)."""
        size = os.path.getsize(temp_path)
        file_id = new_id("file-")
        try:
            with self._transaction() as db:
                self._check_room(db, size)
                _sync(temp_path)
                os.replace(temp_path, self.file_path(file_id))
                db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                           (file_id, scope, purpose, filename, size, int(time.time())))
        finally:
            if os.path.exists(temp_path):
                os.unlink(temp_path)
        return self.get_file(scope, file_id)

    def _check_room(self, db, size: int) -> None:
        count, total = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM files").fetchone()
        if count + 1 > self.limits.max_files:
            raise StoreFullError(f"the server holds {count} files, its limit (--batch-max-files); delete some",
                                 "file")
        if total + size > self.limits.max_bytes:
            raise StoreFullError(f"the server holds {total} bytes of files; {size} more would pass its limit of "
                                 f"{self.limits.max_bytes} (--batch-max-bytes); delete some", "file")

    def get_file(self, scope: str, file_id: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT id, bytes, created_at, filename, purpose FROM files WHERE id = ? AND "
                                   "scope = ?", (file_id, scope)).fetchone()
        return None if row is None else _file_object(row)

    def list_files(self, scope: str, purpose: str | None, after: str | None, limit: int, order: str) -> list[dict]:
        """Files of ``scope``, newest first (``order`` "desc") or oldest first, after the file ``after``."""
        sign = "<" if order == "desc" else ">"
        query = "SELECT id, bytes, created_at, filename, purpose FROM files WHERE scope = ?"
        args: list = [scope]
        if purpose is not None:
            query += " AND purpose = ?"
            args.append(purpose)
        if after is not None:
            query += f" AND rowid {sign} (SELECT rowid FROM files WHERE id = ?)"
            args.append(after)
        query += f" ORDER BY rowid {'DESC' if order == 'desc' else 'ASC'} LIMIT ?"
        with self._lock:
            rows = self._db.execute(query, (*args, limit)).fetchall()
        return [_file_object(row) for row in rows]

    def delete_file(self, scope: str, file_id: str) -> bool:
        with self._transaction() as db:
            deleted = db.execute("DELETE FROM files WHERE id = ? AND scope = ?", (file_id, scope)).rowcount
            if deleted:
                os.unlink(self.file_path(file_id))
        return bool(deleted)

    # ---- batches ----------------------------------------------------------------------------------------
    def add_batch(self, scope: str, batch: dict) -> None:
        """Keep a new job (``batch``: its OpenAI batch object). Forgets the oldest finished jobs to stay within
        ``max_jobs``; StoreFullError when every one of them is still active."""
        with self._transaction() as db:
            count = db.execute("SELECT COUNT(*) FROM batches").fetchone()[0]
            while count >= self.limits.max_jobs:
                marks = ", ".join("?" * len(TERMINAL))
                oldest = db.execute(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq LIMIT 1",
                                    TERMINAL).fetchone()
                if oldest is None:
                    raise StoreFullError(f"{count} batches are in progress, this server's limit (--batch-max-jobs); "
                                         "wait for one to finish or cancel one", "input_file_id")
                db.execute("DELETE FROM batches WHERE id = ?", oldest)
                db.execute("DELETE FROM results WHERE batch_id = ?", oldest)
                count -= 1
            db.execute("INSERT INTO batches (id, scope, status, created_at, total, body) VALUES (?, ?, ?, ?, ?, ?)",
                       (batch["id"], scope, batch["status"], batch["created_at"], batch["request_counts"]["total"],
                        json.dumps(batch)))

    def get_batch(self, scope: str | None, batch_id: str) -> dict | None:
        """The job's batch object with its current request counts (``scope`` None: whoever's, for the runner)."""
        with self._lock:
            row = self._db.execute("SELECT body, scope FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or (scope is not None and row[1] != scope):
                return None
            return self._with_counts(json.loads(row[0]))

    def _with_counts(self, batch: dict) -> dict:
        done, failed = self._db.execute("SELECT COUNT(*), COALESCE(SUM(1 - ok), 0) FROM results WHERE batch_id = ?",
                                        (batch["id"],)).fetchone()
        batch["request_counts"] = {"total": batch["request_counts"]["total"], "completed": done - failed,
                                   "failed": failed}
        return batch

    def list_batches(self, scope: str, after: str | None, limit: int) -> list[dict]:
        """Jobs of ``scope``, newest first, after the job ``after``."""
        query, args = "SELECT body FROM batches WHERE scope = ?", [scope]
        if after is not None:
            query += " AND seq < (SELECT seq FROM batches WHERE id = ?)"
            args.append(after)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY seq DESC LIMIT ?", (*args, limit)).fetchall()
            return [self._with_counts(json.loads(row[0])) for row in rows]

    def active_batch_ids(self) -> list[str]:
        """Jobs still to run or to finish, oldest first (the runner's work, at start-up too)."""
        marks = ", ".join("?" * len(ACTIVE))
        with self._lock:
            return [r[0] for r in self._db.execute(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq",
                                                   ACTIVE)]

    def update_batch(self, batch_id: str, only_from: tuple[str, ...] | None = None, **fields) -> dict | None:
        """Set fields of a job's batch object (``status`` too); with ``only_from``, only while its status is one of
        those. The updated object, or None when it was not updated."""
        with self._transaction() as db:
            row = db.execute("SELECT body FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return None
            batch = json.loads(row[0])
            if only_from is not None and batch["status"] not in only_from:
                return None
            batch.update(fields)
            db.execute("UPDATE batches SET status = ?, body = ? WHERE id = ?",
                       (batch["status"], json.dumps(batch), batch_id))
            return self._with_counts(batch)

    # ---- results ----------------------------------------------------------------------------------------
    def done_lines(self, batch_id: str) -> set[int]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT line FROM results WHERE batch_id = ?", (batch_id,))}

    def record(self, batch_id: str, line: int, ok: bool, record: dict) -> bool:
        """A line's result, atomically; False when the line already had one (it is kept, this one dropped)."""
        with self._lock:
            inserted = self._db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                                        (batch_id, line, int(ok), json.dumps(record, separators=(",", ":"))))
        return inserted.rowcount == 1

    def finalize(self, batch_id: str, status: str, **fields) -> dict | None:
        """End a job: write its output file (its successful lines' results, in input order) and its error file (the
        failed lines'), each only when it has lines, and set its status, the two file ids and ``fields``, all in one
        transaction (a crash before it commits leaves files no row names, which the next start sweeps). The job's
        updated batch object; None when it was not found. The files are the server's own: never refused for room
        (a job's results must not be lost to a full store), but counted against the bounds."""
        with self._lock:
            row = self._db.execute("SELECT scope FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            return None
        written: list[tuple[str, str, str]] = []  # (file id, temporary path, name)
        for ok, name in ((1, "output"), (0, "errors")):
            with self._lock:
                records = [r[0] for r in self._db.execute(
                    "SELECT record FROM results WHERE batch_id = ? AND ok = ? ORDER BY line", (batch_id, ok))]
            if records:
                temp = self.temp_path()
                with open(temp, "w", encoding="utf-8") as f:
                    f.writelines(record + "\n" for record in records)
                _sync(temp)
                written.append((new_id("file-"), temp, name))
        ids = {name: file_id for file_id, _, name in written}
        with self._transaction() as db:
            for file_id, temp, name in written:
                os.replace(temp, self.file_path(file_id))
                db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                           (file_id, row[0], "batch_output", f"{batch_id}_{name}.jsonl",
                            os.path.getsize(self.file_path(file_id)), int(time.time())))
            body = json.loads(db.execute("SELECT body FROM batches WHERE id = ?", (batch_id,)).fetchone()[0])
            body.update(fields, status=status, output_file_id=ids.get("output"), error_file_id=ids.get("errors"))
            db.execute("UPDATE batches SET status = ?, body = ? WHERE id = ?", (status, json.dumps(body), batch_id))
            return self._with_counts(body)


class _Transaction:
    """``with``: the lock held and one SQLite transaction (BEGIN IMMEDIATE ... COMMIT, ROLLBACK on an error)."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        self.db, self.lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind, value, tb) -> None:
        try:
            self.db.execute("COMMIT" if kind is None else "ROLLBACK")
        finally:
            self.lock.release()


def _hold_directory(data_dir: str):
    """An exclusive lock on ``data_dir`` for this process's life (the kernel drops it when the process dies, killed
    or not); StoreInUseError naming the holder when another process has it."""
    import fcntl

    owner = open(os.path.join(data_dir, "server.lock"), "a+")
    try:
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner.seek(0)
        holder = owner.read().strip() or "?"
        owner.close()
        raise StoreInUseError(f"{data_dir} is in use by another conveyor server (pid {holder})") from None
    owner.seek(0)
    owner.truncate()
    owner.write(str(os.getpid()))
    owner.flush()
    return owner


def _sync(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _file_object(row) -> dict:
    file_id, size, created, filename, purpose = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}
