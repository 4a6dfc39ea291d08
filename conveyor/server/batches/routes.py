"""``/v1/files`` and ``/v1/batches`` in OpenAI's formats, over a ``BatchStore`` and a ``BatchRunner``. Every
object is scoped by the API key that made it: another key's file or batch is a 404, as one that does not exist."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field

from conveyor.server.auth import key_scope
from conveyor.server.batches.input_file import BATCH_ENDPOINTS, InputFileError, check_input_file
from conveyor.server.batches.runner import BatchRunner
from conveyor.server.batches.store import ACTIVE, BatchStore, StoreFullError, new_id
from conveyor.server.errors import APIError, bad_request

COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds on metadata
ListLimit = Annotated[int, Query(ge=1, le=10_000)]


class CreateBatchRequest(BaseModel):
    """POST /v1/batches."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str
    completion_window: str
    metadata: dict[Annotated[str, Field(max_length=MAX_METADATA_KEY)],
                   Annotated[str, Field(max_length=MAX_METADATA_VALUE)]] | None = \
        Field(default=None, max_length=MAX_METADATA_PAIRS)


def _not_found(what: str, object_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No such {what}: '{object_id[:128]}'", param, "not_found")


def _page(data: list[dict], limit: int) -> dict:
    """OpenAI's list object (the store was asked for one more than ``limit``, to tell ``has_more``)."""
    shown = data[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(data) > limit}


def install_batch_routes(app: FastAPI, store: BatchStore, runner: BatchRunner) -> None:
    """The files and batches routes."""

    @app.post("/v1/files")
    async def upload_file(raw: Request):
        if not raw.headers.get("content-type", "").startswith("multipart/form-data"):
            raise bad_request("send the file as multipart/form-data with the fields file and purpose", "file")
        async with raw.form(max_files=1, max_fields=8) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise bad_request(f"purpose must be 'batch' on this server (the Batch API's input), got "
                                  f"{str(purpose)[:40]!r}", "purpose")
            if upload is None or isinstance(upload, str):
                raise bad_request("file is missing: send the file's contents as the multipart field 'file'", "file")
            filename = os.path.basename(upload.filename or "upload.jsonl")[:256]
            temp = store.temp_path()
            try:
                size = await asyncio.to_thread(_copy, upload.file, temp)
                if size > store.limits.max_file_bytes:
                    raise APIError(413, f"the file has {size} bytes, more than this server's limit of "
                                   f"{store.limits.max_file_bytes} per file (--batch-max-file-bytes)", "file",
                                   "file_too_large")
                try:
                    await asyncio.to_thread(check_input_file, temp, store.limits.max_lines)
                except InputFileError as exc:
                    raise bad_request(f"the file is not a valid batch input: {exc}", "file", exc.code) from None
                try:
                    return await asyncio.to_thread(store.add_file, key_scope(raw), temp, filename, "batch")
                except StoreFullError as exc:
                    raise APIError(400, str(exc), exc.param, "storage_full") from None
            finally:
                if os.path.exists(temp):
                    os.unlink(temp)

    @app.get("/v1/files")
    async def list_files(raw: Request, purpose: str | None = None, after: str | None = None,
                         limit: ListLimit = 10_000, order: str = "desc"):
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', got {order[:20]!r}", "order")
        files = await asyncio.to_thread(store.list_files, key_scope(raw), purpose, after, limit + 1, order)
        return _page(files, limit)

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str, raw: Request):
        return await _owned(store.get_file, "file", raw, file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, raw: Request):
        found = await _owned(store.get_file, "file", raw, file_id)
        return FileResponse(store.file_path(file_id), media_type="application/octet-stream",
                            filename=found["filename"])

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, raw: Request):
        if not await asyncio.to_thread(store.delete_file, key_scope(raw), file_id):
            raise _not_found("file", file_id, "file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create_batch(body: CreateBatchRequest, raw: Request):
        scope = key_scope(raw)
        if body.endpoint not in BATCH_ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {body.endpoint[:80]!r}",
                              "endpoint")
        if body.completion_window not in COMPLETION_WINDOWS:
            raise bad_request(f"completion_window must be '24h', got {body.completion_window[:20]!r}",
                              "completion_window")
        found = await asyncio.to_thread(store.get_file, scope, body.input_file_id)
        if found is None:
            raise _not_found("file", body.input_file_id, "input_file_id")
        if found["purpose"] != "batch":
            raise bad_request(f"file {body.input_file_id} has purpose {found['purpose']!r}, not 'batch'",
                              "input_file_id")
        endpoint, total = await asyncio.to_thread(check_input_file, store.file_path(body.input_file_id),
                                                  store.limits.max_lines)
        if endpoint != body.endpoint:
            raise bad_request(f"the input file's requests are for {endpoint}, not {body.endpoint}", "endpoint")
        now = int(time.time())
        batch = {"id": new_id("batch_"), "object": "batch", "endpoint": body.endpoint, "errors": None,
                 "input_file_id": body.input_file_id, "completion_window": body.completion_window,
                 "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
                 "in_progress_at": None, "expires_at": now + COMPLETION_WINDOWS[body.completion_window],
                 "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
                 "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": total, "completed": 0, "failed": 0}, "metadata": body.metadata}
        try:
            await asyncio.to_thread(store.add_batch, scope, batch)
        except StoreFullError as exc:
            raise APIError(429, str(exc), exc.param, "too_many_batches") from None
        runner.wake()
        return batch

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str, raw: Request):
        return await _owned(store.get_batch, "batch", raw, batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, raw: Request):
        batch = await _owned(store.get_batch, "batch", raw, batch_id)
        if batch["status"] not in ACTIVE or batch["status"] == "cancelling":
            return batch  # OpenAI answers a finished batch's cancel with the batch as it is
        updated = await asyncio.to_thread(store.update_batch, batch_id, ("validating", "in_progress"),
                                          status="cancelling", cancelling_at=int(time.time()))
        runner.cancel(batch_id)
        return updated or await _owned(store.get_batch, "batch", raw, batch_id)

    @app.get("/v1/batches")
    async def list_batches(raw: Request, after: str | None = None, limit: ListLimit = 20):
        batches = await asyncio.to_thread(store.list_batches, key_scope(raw), after, limit + 1)
        return _page(batches, limit)


async def _owned(get, what: str, raw: Request, object_id: str) -> dict:
    """The file or batch ``object_id`` of the key ``raw`` presents (``get``: the store's lookup); 404 otherwise."""
    found = await asyncio.to_thread(get, key_scope(raw), object_id)
    if found is None:
        raise _not_found(what, object_id, f"{what}_id")
    return found


def _copy(source, path: str) -> int:
    with open(path, "wb") as target:
        shutil.copyfileobj(source, target, 1 << 20)
        return target.tell()

