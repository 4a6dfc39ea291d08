"""Errors in the shape of the protocol a request speaks, with the matching status: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (chat, completions, Responses and everything else),
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` under ``/v1/messages``, Ollama's ``{"error": "..."}``
under ``/api/``.

Handlers turn every failure (our own ``APIError``, pydantic validation, invalid JSON, unknown routes, engine
exceptions) into that shape, so the official clients raise their typed exceptions (BadRequestError, ...).
"""

from __future__ import annotations

import logging
import re
from dataclasses import fields

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.chat import FinalMessageError
from conveyor.engine.engine_client import EngineDeadError, EngineShuttingDownError, RequestFailedError
from conveyor.engine.engine_client import QueueFullError

logger = logging.getLogger("conveyor.server")

RETRY_AFTER_S = 1  # what a full queue asks clients to wait; one second is many engine steps

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
          503: "service_unavailable"}


class APIError(Exception):
    """An error to report to the client as-is."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        if status >= 500:  # a server error's text may come from anywhere: never a trace or a path
            message = client_text(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self, path: str = "") -> dict:
        """This error in the shape of the protocol served under ``path`` (OpenAI's by default)."""
        for prefix, shape in ERROR_SHAPES:
            if path.startswith(prefix):
                return shape(self)
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)


# Anthropic's error types by status (docs.anthropic.com, "Errors"); its SDK raises its typed exceptions by status.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(error: APIError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(error.status, "invalid_request_error"),
                                       "message": error.message}}


def ollama_error(error: APIError) -> dict:
    return {"error": error.message}


ERROR_SHAPES = (("/v1/messages", anthropic_error), ("/api/", ollama_error))


# What may not reach a client in a server error's text: where a native or Python stack trace starts, and file paths
# (the build machine's, the server's): the reliability probe of 2026-12-06 found a Rust panic's backtrace, with
# absolute paths, in a 500's message.
_TRACE_STARTS = ("Traceback (most recent call last)", "<backtrace>", "stack backtrace:")
_FILE_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][^\s/\\:'\"(),<>]+){2,}(?::\d+)*")


def client_text(message: str) -> str:
    """A server error's message as a client may read it: cut where a stack trace starts, file paths replaced by
    ``<path>``, at most 1,000 characters."""
    for marker in _TRACE_STARTS:
        message = message.split(marker, 1)[0]
    return _FILE_PATH.sub("<path>", message).strip()[:1000] or "internal error"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_value_error(exc: ValueError) -> APIError:
    """SamplingParams / LLMEngine raise ValueError whose message starts with the offending field's name."""
    message = str(exc)
    first = message.split(" ", 1)[0].rstrip(":").split(".", 1)[0]  # "structured_outputs.json: ..." too
    return APIError(400, message, first if first in _PARAM_NAMES else None)


_PARAM_NAMES = {f.name for f in fields(SamplingParams)} | {
    "prompt", "messages", "max_completion_tokens", "response_format", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "tools", "tool_choice",
    "model", "input", "dimensions", "query", "documents", "text_1", "text_2", "truncate_prompt_tokens"}


def from_engine_error(exc: BaseException) -> APIError:
    """Map what ``ServedEngine.add_request`` raises (or a ``Prepare`` it ran) to a status."""
    if isinstance(exc, FinalMessageError):  # render_chat: the conversation cannot be continued as asked
        return bad_request(str(exc), "continue_final_message")
    if isinstance(exc, ValueError):
        return from_value_error(exc)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineShuttingDownError):
        return APIError(503, str(exc), code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):  # the server exits now (see launcher): no Retry-After
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, RequestFailedError):  # the engine logged it and went on; only this request is lost
        return APIError(500, f"the engine could not process this request: {exc}", code="request_failed")
    logger.exception("unexpected error", exc_info=exc)
    return APIError(500, f"internal error: {exc!r}")


def validation_error(exc: RequestValidationError) -> APIError:
    """A body that failed its request model, as vLLM and OpenAI answer it: 400 (not FastAPI's 422), naming the
    first field at fault."""
    message, param = _validation_message(exc)
    return APIError(400, message, param)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"invalid JSON body: {first.get('msg')}", None
    where = ".".join(loc)
    return (f"{where}: {first.get('msg')}" if where else str(first.get("msg"))), (loc[0] if loc else None)


def install_error_handlers(app: FastAPI) -> None:
    """Every error response of ``app`` in the shape of the protocol of its route (``APIError.body``)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = "Not Found" if exc.status_code == 404 else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        code = "request_too_large" if exc.status_code == 413 else None  # a body read past the cap (body_limit.py)
        error = APIError(exc.status_code, message, code=code, headers=getattr(exc, "headers", None))
        return error.response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return from_engine_error(exc).response(request.url.path)
