"""The request body's bounds, in pure ASGI: a size cap (413) that counts the bytes as they arrive, and no
compressed bodies (415), which would otherwise be read as if they were plain JSON."""

from __future__ import annotations

from fastapi import HTTPException

from conveyor.server.errors import APIError


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


def too_large(max_bytes: int, declared: int | None = None, flag: str = "--max-request-body-bytes") -> APIError:
    """413 (``declared``: the Content-Length); the connection is closed after it, since the rest of the body is
    never read."""
    size = f" of {declared} bytes (Content-Length)" if declared is not None else ""
    return APIError(413, f"the request body{size} is over this server's limit of {max_bytes} bytes "
                    f"({flag})", code="request_too_large", headers={"Connection": "close"})


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` (413) and compressed ones (415), in pure ASGI like
    ``APIKeyMiddleware``: responses, SSE streams included, pass through untouched and nothing is buffered.

    A ``Content-Length`` over the cap is answered before a byte of the body is read. Otherwise the bytes are counted
    as the app reads them (chunked transfer has no Content-Length): the chunk that crosses the cap is the last one
    read, and the read raises an HTTP 413 in the app (FastAPI passes HTTP errors from a body read through to the
    error handlers); the connection then closes, the rest of the body unread. The app is never handed more than the
    cap. Only ``receive`` is wrapped: wrapping ``send`` as well put a frame on every SSE chunk's path, which
    measured about 1 ms a token on a batch-1 stream (/tmp/s/itl.py, --engine-in-process, alternated).
    """

    def __init__(self, app, max_bytes: int, larger: dict[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = larger or {}  # path -> its own cap and the flag that sets it (the Batch API's file uploads)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes, flag = self.larger.get(scope.get("path", ""), (self.max_bytes, "--max-request-body-bytes"))
        refusal = _refuse_by_headers(scope["headers"], max_bytes, flag)
        if refusal is not None:
            await refusal.response(scope["path"])(scope, receive, send)
            return
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    error = too_large(max_bytes, flag=flag)
                    raise HTTPException(error.status, error.message, headers=error.headers)
            return message

        await self.app(scope, counting_receive, send)
