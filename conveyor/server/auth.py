"""API keys: the check every route but monitoring passes (``APIKeyMiddleware``), and the scope a key gives what a
client stores (``key_scope``: the Responses store keeps each key's responses apart).

A key is sent as OpenAI's clients send it (``Authorization: Bearer <key>``) or as Anthropic's do
(``x-api-key: <key>``). ``--api-key`` may name several keys; any of them is accepted.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from conveyor.server.errors import APIError

OPEN_PATHS = ("/health", "/metrics")  # monitoring must work without the API key, as in vLLM


def presented_key(headers) -> bytes | None:
    """The key a request presents (``headers``: ASGI header pairs or a mapping of lower-case names), or None."""
    found = dict(headers) if not hasattr(headers, "get") else headers
    bearer = found.get(b"authorization") or b""
    if bearer[:7].lower() == b"bearer ":
        return bearer[7:].strip()
    return found.get(b"x-api-key")


def key_scope(request: Request) -> str:
    """Whose stored state a request may read: a digest of the key it presents ("" with none). Keys are never
    stored, only this digest."""
    key = presented_key([(k.lower(), v) for k, v in request.headers.raw])
    return hashlib.sha256(key).hexdigest() if key else ""


class APIKeyMiddleware:
    """Refuse requests that present none of ``api_keys`` (pure ASGI: it must not buffer SSE streams); the 401
    comes in the shape of the route's protocol."""

    def __init__(self, app, api_keys: list[str]) -> None:
        self.app = app
        self.expected = [k.encode() for k in api_keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            given = presented_key(scope["headers"]) or b""
            # compare_digest against every key, so the time taken does not tell which key came closest
            if not sum(hmac.compare_digest(given, key) for key in self.expected):
                error = APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>' or "
                                 "'x-api-key: <key>')", code="invalid_api_key")
                await error.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
