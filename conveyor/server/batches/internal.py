"""One batch line through the server's own endpoint handler, as an HTTP request to that route would go (the same
body model, checks, engine path and answer), without a socket: the handler is called with a request whose only
event is the disconnect that cancelling the batch sends (``cancel``), which aborts the line as a client that hangs
up aborts its request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from conveyor.server.errors import APIError, from_engine_error, validation_error

Handler = Callable[[BaseModel, Request], Awaitable]
Routes = dict[str, tuple[type[BaseModel], Handler]]  # url -> (its body model, its handler)
Dispatch = Callable[[str, dict, asyncio.Event], Awaitable[tuple[int, dict]]]


def internal_dispatch(routes: Routes) -> Dispatch:
    """``dispatch(url, body, cancel) -> (status code, answer body)`` over ``routes``: every failure is an answer
    (an error in the route's shape with its status), never an exception."""

    async def dispatch(url: str, body: dict, cancel: asyncio.Event) -> tuple[int, dict]:
        model, handler = routes[url]
        try:
            parsed = model.model_validate(body)
            response = await handler(parsed, _disconnect_only(url, cancel))
        except ValidationError as exc:
            error = validation_error(RequestValidationError(exc.errors()))
            return error.status, error.body(url)
        except APIError as exc:
            return exc.status, exc.body(url)
        except Exception as exc:  # noqa: BLE001 - an answer, as the app's own handler makes it
            error = from_engine_error(exc)
            return error.status, error.body(url)
        return response.status_code, json.loads(response.body)

    return dispatch


def _disconnect_only(path: str, cancel: asyncio.Event) -> Request:
    async def receive() -> dict:
        await cancel.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [], "scheme": "http", "server": None, "client": None, "root_path": ""}
    return Request(scope, receive)
