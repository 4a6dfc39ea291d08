"""CORS for browser clients (web UIs calling the API from another origin), flags and defaults as ``vllm serve``'s:
``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers`` (JSON lists, default ``["*"]``) and
``--allow-credentials`` (default off), served by Starlette's ``CORSMiddleware``
(for requests from browsers only: ``OriginCORSMiddleware``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class CORSConfig:
    """What ``CORSMiddleware`` allows; the defaults are vLLM's (any origin, method and header; no credentials)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> CORSConfig:
        """The config of ``conveyor serve``'s parsed flags (``add_cors_args``)."""
        return cls(tuple(ns.allowed_origins), tuple(ns.allowed_methods), tuple(ns.allowed_headers),
                   bool(ns.allow_credentials))


def _json_list(text: str) -> list[str]:
    """A flag's JSON list of strings, as vLLM parses these flags (json.loads), checked so that a typo such as
    ``--allowed-origins https://a.example`` fails at startup instead of allowing nothing."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"https://a.example\"]', "
                                         f"got {text!r} ({exc})") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def add_cors_args(p: argparse.ArgumentParser) -> None:
    """``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``, ``--allow-credentials``."""
    g = p.add_argument_group("CORS (browser clients on other origins)")
    default = CORSConfig()
    g.add_argument("--allowed-origins", type=_json_list, default=list(default.allowed_origins),
                   help='origins allowed to call the API from a browser, a JSON list (default ["*"]: any)')
    g.add_argument("--allowed-methods", type=_json_list, default=list(default.allowed_methods),
                   help='HTTP methods allowed cross-origin, a JSON list (default ["*"])')
    g.add_argument("--allowed-headers", type=_json_list, default=list(default.allowed_headers),
                   help='request headers allowed cross-origin, a JSON list (default ["*"])')
    g.add_argument("--allow-credentials", action="store_true",
                   help="let browsers send cookies and HTTP auth cross-origin (Access-Control-Allow-Credentials)")


class OriginCORSMiddleware:
    """Starlette's ``CORSMiddleware`` for requests that carry an ``Origin`` header (browsers send it on every
    cross-origin request, and on preflights); the others go straight to the app. Starlette wraps ``send`` for
    every request it sees, which would put a frame on every SSE chunk's path (``body_limit.py`` measured that
    at about 1 ms a token) for clients, the SDKs and curl, that never read CORS headers. Those responses then
    lack Starlette's ``Vary: Origin``, which only a shared cache between browser and non-browser clients would
    miss."""

    def __init__(self, app, **cors_kwargs) -> None:
        self.app = app
        self.cors = CORSMiddleware(app, **cors_kwargs)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and any(key == b"origin" for key, _ in scope["headers"]):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def install_cors(app, config: CORSConfig) -> None:
    """Add the middleware to ``app``. Call it after every other ``add_middleware``: the last added runs first,
    so preflights are answered before the API key check and the body limit, and the answers of both (401, 413,
    415) carry the CORS headers a browser needs to let the page read them. (Not an unexpected exception's 500:
    Starlette answers those outside every user middleware; the handlers turn the expected ones into APIError.)"""
    app.add_middleware(OriginCORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials)
