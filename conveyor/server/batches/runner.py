"""Runs batch jobs: each line through the server's own endpoint (``internal.py``) at the lowest priority, so the
engine's scheduler gives batch lines the slots and step budget that interactive requests leave and takes them back
at the next step when interactive work arrives (``core/policies/priority.py``).

A job runs its lines with at most ``concurrency`` in flight, oldest job first. A finished line's answer is recorded
at once (``BatchStore.record``), so a job that a crash or a restart interrupted resumes with the lines that have no
result, and none runs twice to completion. An answer that says "try again" (the engine's queue is full, the server
is shutting down, the engine died, the line was cancelled) is not a result: the line is left for later. Cancelling a
job aborts its lines in flight; the job ends "cancelled" with the results it had.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

from conveyor.server.batches.input_file import BatchLine, read_lines
from conveyor.server.batches.internal import Dispatch
from conveyor.server.batches.store import BatchStore, new_id

logger = logging.getLogger("conveyor.server")

RETRY_STATUSES = (429, 499, 503)  # not a line's answer: it runs again later
RETRY_DELAY_S = 1.0
READ_CHUNK = 256  # lines read from the input file per worker-thread call


class BatchRunner:
    """The background task that runs every active job of ``store``; ``wake()`` after adding or cancelling one."""

    def __init__(self, store: BatchStore, dispatch: Dispatch, concurrency: int = 64, poll_s: float = 5.0) -> None:
        if concurrency < 1:
            raise ValueError(f"batch concurrency must be >= 1, got {concurrency}")
        self.store, self.dispatch, self.concurrency, self.poll_s = store, dispatch, concurrency, poll_s
        self._wake = asyncio.Event()
        self._cancelled: dict[str, asyncio.Event] = {}  # job id -> set when the job is cancelled
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run_forever())

    async def stop(self) -> None:
        """Stop at once: lines in flight are aborted and left without a result (they run again at the next start)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """Abort the lines of a job that is running now (its status is "cancelling" already)."""
        event = self._cancelled.get(batch_id)
        if event is not None:
            event.set()
        self.wake()

    async def _run_forever(self) -> None:
        while True:
            self._wake.clear()
            for batch_id in await asyncio.to_thread(self.store.active_batch_ids):
                try:
                    await self._run_job(batch_id)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - one job's failure must not stop the others
                    logger.exception("batch %s failed", batch_id)
                    await asyncio.to_thread(self.store.finalize, batch_id, "failed", failed_at=int(time.time()),
                                            errors=_errors("internal_error", "the server failed to run this batch"))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)

    async def _run_job(self, batch_id: str) -> None:
        store = self.store
        batch = await asyncio.to_thread(store.get_batch, None, batch_id)
        if batch is None:
            return
        now = int(time.time())
        if batch["status"] == "validating":
            batch = await asyncio.to_thread(store.update_batch, batch_id, ("validating",), status="in_progress",
                                            in_progress_at=now)
            if batch is None:  # cancelled meanwhile
                return
        if batch["status"] == "in_progress":
            cancelled = self._cancelled.setdefault(batch_id, asyncio.Event())
            try:
                expired = await self._run_lines(batch, cancelled)
            finally:
                self._cancelled.pop(batch_id, None)
            batch = await asyncio.to_thread(store.get_batch, None, batch_id)
            if batch["status"] == "in_progress":
                if expired:
                    await asyncio.to_thread(store.finalize, batch_id, "expired", expired_at=int(time.time()))
                    return
                batch = await asyncio.to_thread(store.update_batch, batch_id, ("in_progress",),
                                                status="finalizing", finalizing_at=int(time.time()))
        if batch is None:
            return
        if batch["status"] == "finalizing":
            await asyncio.to_thread(store.finalize, batch_id, "completed", completed_at=int(time.time()))
        elif batch["status"] == "cancelling":
            await asyncio.to_thread(store.finalize, batch_id, "cancelled", cancelled_at=int(time.time()))

    async def _run_lines(self, batch: dict, cancelled: asyncio.Event) -> bool:
        """Run the job's lines that have no result until all have one, the job is cancelled, or it expires; True
        when it expired (its unfinished lines then get a ``batch_expired`` error each)."""
        batch_id = batch["id"]
        done = await asyncio.to_thread(self.store.done_lines, batch_id)
        path = self.store.file_path(batch["input_file_id"])
        lines = _chunks(read_lines(path))
        slots = asyncio.Semaphore(self.concurrency)
        running: set[asyncio.Task] = set()
        expired = False
        try:
            while not cancelled.is_set():
                chunk = await asyncio.to_thread(next, lines, None)
                if chunk is None:
                    break
                for line in chunk:
                    if line.index in done:
                        continue
                    await slots.acquire()
                    if cancelled.is_set():
                        slots.release()
                        break
                    if time.time() >= batch["expires_at"]:
                        slots.release()
                        expired = True
                        await self._expire(batch_id, line)
                        continue
                    task = asyncio.create_task(self._run_line(batch_id, line, cancelled))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    task.add_done_callback(lambda _: slots.release())
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        except BaseException:
            cancelled.set()  # stopping: abort the lines in flight
            if running:
                await asyncio.gather(*running, return_exceptions=True)
            raise
        return expired

    async def _run_line(self, batch_id: str, line: BatchLine, cancelled: asyncio.Event) -> None:
        while True:
            status, answer = await self.dispatch(line.url, line.body, cancelled)
            if status not in RETRY_STATUSES:
                break
            if cancelled.is_set():
                return
            await asyncio.sleep(RETRY_DELAY_S)
        record = {"id": new_id("batch_req_"), "custom_id": line.custom_id,
                  "response": {"status_code": status, "request_id": str(answer.get("id", "")), "body": answer},
                  "error": None}
        await asyncio.to_thread(self.store.record, batch_id, line.index, 200 <= status < 300, record)

    async def _expire(self, batch_id: str, line: BatchLine) -> None:
        record = {"id": new_id("batch_req_"), "custom_id": line.custom_id, "response": None,
                  "error": {"code": "batch_expired", "message": "This request could not be executed before the "
                            "completion window expired."}}
        await asyncio.to_thread(self.store.record, batch_id, line.index, False, record)


def _chunks(lines: Iterator[BatchLine]) -> Iterator[list[BatchLine]]:
    chunk: list[BatchLine] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == READ_CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _errors(code: str, message: str, line: int | None = None, param: str | None = None) -> dict:
    """A batch object's ``errors``, in OpenAI's shape."""
    return {"object": "list", "data": [{"code": code, "message": message, "param": param, "line": line}]}
