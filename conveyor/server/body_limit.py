"""The request body's bounds, in pure ASGI: a size cap (413) that counts the bytes as they arrive, and no
compressed bodies (415), which would otherwise be read as if they were plain JSON.

A refusal is an answer the client can read. An HTTP/1.1 client without ``Expect: 100-continue`` (httpx, and so
the openai SDK; curl for small bodies) sends its whole body before it reads anything: a server that answers early
and closes the connection leaves it a broken pipe, never the 413. So the rest of a refused body is read and
discarded first, up to ``DRAIN_MAX_BYTES`` and ``DRAIN_TIMEOUT_S`` (beyond either, the answer goes out and the
connection closes, the client may see only that); a client that asked for ``100 Continue`` has sent nothing yet
and gets the answer at once.
"""

from __future__ import annotations

import asyncio

from fastapi import HTTPException

from conveyor.server.errors import APIError

# How much of a refused body is read and discarded so that the client reads the answer: the bytes cost only
# bandwidth (a chunk at a time, never held), and 64 MiB takes a fraction of a second on a LAN.
DRAIN_MAX_BYTES = 64 * 1024 * 1024
DRAIN_TIMEOUT_S = 10.0


def _header_values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [value for key, value in headers if key == name]  # ASGI servers lower-case header names


def _refuse_by_headers(headers: list[tuple[bytes, bytes]], max_bytes: int, flag: str) -> APIError | None:
    """The answer to a request its headers already disqualify: a compressed body (which would be read as if it
    were plain JSON) or a declared length over the cap."""
    for value in _header_values(headers, b"content-encoding"):
        codings = [c.strip().lower() for c in value.split(b",") if c.strip()]
        if any(c != b"identity" for c in codings):
            return APIError(415, f"Content-Encoding {value.decode('latin-1')!r} is not supported: send the request "
                            "body uncompressed", code="unsupported_media_type", headers={"Connection": "close"})
    for value in _header_values(headers, b"content-length"):
        if value.strip().isdigit() and int(value) > max_bytes:
            return too_large(max_bytes, int(value), flag)
    return None


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    values = [v.strip() for v in _header_values(headers, b"content-length")]
    return int(values[0]) if values and values[0].isdigit() else None


def _expects_continue(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(v.strip().lower() == b"100-continue" for v in _header_values(headers, b"expect"))


async def drain(receive, limit: int = DRAIN_MAX_BYTES) -> bool:
    """Read and discard the rest of the request body; True when it ended within ``limit`` bytes and
    ``DRAIN_TIMEOUT_S`` (False: too much, too slow, or the client left)."""
    drained = 0
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return False
                drained += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return True
                if drained > limit:
                    return False
    except TimeoutError:
        return False


def too_large(max_bytes: int, declared: int | None = None, flag: str = "--max-request-body-bytes") -> APIError:
    """413 (``declared``: the Content-Length); the connection is closed after it (the body may not have been read
    to its end)."""
    size = f" of {declared} bytes (Content-Length)" if declared is not None else ""
    return APIError(413, f"the request body{size} is over this server's limit of {max_bytes} bytes "
                    f"({flag})", code="request_too_large", headers={"Connection": "close"})


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` (413) and compressed ones (415), in pure ASGI like
    ``APIKeyMiddleware``: responses, SSE streams included, pass through untouched and nothing is buffered.

    A ``Content-Length`` over the cap is refused before the app reads a byte of the body (at once for a client that
    waits for ``100 Continue``, else once the body is drained: module docstring). Otherwise the bytes are counted
    as the app reads them (chunked transfer has no Content-Length): the chunk that crosses the cap is the last one
    the app gets; the rest is drained and the read raises an HTTP 413 in the app (FastAPI passes HTTP errors from a
    body read through to the error handlers). The app is never handed more than the cap. Only ``receive`` is
    wrapped: wrapping ``send`` as well put a frame on every SSE chunk's path, which measured about 1 ms a token on a
    batch-1 stream (/tmp/s/itl.py, --engine-in-process, alternated).
    """

    def __init__(self, app, max_bytes: int, larger: dict[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = larger or {}  # path -> its own cap and the flag that sets it (the Batch API's file uploads)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        max_bytes, flag = self.larger.get(scope.get("path", ""), (self.max_bytes, "--max-request-body-bytes"))
        refusal = _refuse_by_headers(headers, max_bytes, flag)
        if refusal is not None:
            declared = _declared_length(headers)
            if not _expects_continue(headers) and (declared is None or declared <= DRAIN_MAX_BYTES):
                await drain(receive)
            await refusal.response(scope["path"])(scope, receive, send)
            return
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    if message.get("more_body", False):
                        await drain(receive)
                    error = too_large(max_bytes, flag=flag)
                    raise HTTPException(error.status, error.message, headers=error.headers)
            return message

        await self.app(scope, counting_receive, send)
