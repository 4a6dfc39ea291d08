"""The Ollama API over the one chat path: ``/api/chat`` and ``/api/generate`` (NDJSON streams, or one object with
``stream: false``), ``/api/tags``, ``/api/show``, ``/api/ps`` and ``/api/version``; errors as Ollama's
``{"error": "..."}``.

Model names are resolved as Ollama clients send them: the served name, with or without a ``:tag``
(``SmolLM2-135M-Instruct:latest``), in any case; another name is Ollama's 404. ``/api/tags`` lists every model
the server can serve, ``/api/ps`` the loaded ones; ``keep_alive`` sets how long a model stays loaded once idle
where the server loads models on demand (``model_pool.py``). ``/api/embed`` and
``/api/embeddings`` are in ``embed.py``, over the embedding path.
"""

from __future__ import annotations

import dataclasses
import json
import time
import weakref
from collections.abc import AsyncIterator
from datetime import datetime, timezone

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from conveyor.server.chat_plan import check_plan, internal_request, plan_chat
from conveyor.server.chat_run import ChatRun
from conveyor.server.errors import ollama_error
from conveyor.server.ollama.model_card import ModelCard, served_name
from conveyor.server.ollama.protocol import (
    ChatRequest, GenerateRequest, ShowRequest, chat_body, generate_body, keep_alive_seconds,
)
from conveyor.server.reply import ReplyDelta
from conveyor.server.served_models import ModelEntry, ModelRouter
from conveyor.server.serving_common import ServingContext, guarded_stream

OLLAMA_API_VERSION = "0.12.0"  # the version of Ollama's API these routes speak (clients gate features on it)
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "abort": "stop"}


def now() -> str:
    """Ollama's timestamps: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _line(data: dict) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n"


class OllamaService:
    """The routes' work: names resolved (loading the model where the server loads on demand), requests planned,
    replies written as Ollama's objects."""

    def __init__(self, served: ModelRouter) -> None:
        self.served = served
        self._cards: weakref.WeakKeyDictionary[ServingContext, ModelCard] = weakref.WeakKeyDictionary()

    def _card(self, entry: ModelEntry) -> ModelCard:
        if entry.ctx is None:
            return ModelCard.on_disk(entry.name, entry.path)
        card = self._cards.get(entry.ctx)
        if card is None:
            card = self._cards[entry.ctx] = ModelCard.of(entry.ctx)
        return card

    async def _context(self, name: str | None, keep_alive) -> ServingContext:
        return await self.served.resolve(served_name([e.name for e in self.served.entries()], name), "generate", keep_alive_seconds(keep_alive))

    async def chat(self, body: ChatRequest, raw: Request):
        ctx = await self._context(body.model, body.keep_alive)
        if not body.messages:  # Ollama's way to load a model (or, keep_alive 0, to unload it once idle)
            return self._loaded(body.model, {"message": {"role": "assistant", "content": ""}}, body.keep_alive)
        fields = chat_body(body, ctx.model_name, ctx.max_model_len)
        plan = await check_plan(plan_chat(internal_request(fields), ctx), ctx)
        return await self._answer(plan, ctx, raw, body.model, body.stream, body.thinks, chat=True)

    async def generate(self, body: GenerateRequest, raw: Request):
        ctx = await self._context(body.model, body.keep_alive)
        if not body.prompt and not body.context:
            return self._loaded(body.model, {"response": ""}, body.keep_alive)
        fields = generate_body(body, ctx.model_name, ctx.max_model_len)
        plan = plan_chat(internal_request(fields), ctx)
        plan = dataclasses.replace(plan, raw_prompt=body.prompt if body.raw else None,
                                   prefix_ids=tuple(body.context or ()))
        plan = await check_plan(plan, ctx)
        return await self._answer(plan, ctx, raw, body.model, body.stream, body.thinks, chat=False)

    def _loaded(self, name: str, empty: dict, keep_alive) -> JSONResponse:
        reason = "unload" if keep_alive_seconds(keep_alive) == 0 else "load"
        return JSONResponse({"model": name, "created_at": now(), **empty, "done": True, "done_reason": reason})

    async def _answer(self, plan, ctx: ServingContext, raw: Request, name: str, stream: bool, thinks: bool | None,
                      chat: bool):
        started = time.monotonic_ns()
        run = await plan.submit(ctx, raw, prefix="ollama")
        shape = _Shape(run, name, chat, keep_thinking=thinks is not False, started=started)
        if stream:
            lines = _lines(shape)
            return StreamingResponse(guarded_stream(lines, ctx, run.streams, lambda e: _line(ollama_error(e))),
                                     media_type="application/x-ndjson")
        (result,) = await run.results(raw)
        calls = [(c.name, c.arguments) for c in result.tool_calls]
        return JSONResponse(shape.final(ReplyDelta(result.reasoning, result.content), calls, result.finish_reason,
                                        result.num_tokens))

    async def tags(self) -> dict:  # async: served on the event loop, as the router's other readers are
        """Every model this server can serve, loaded or not."""
        return {"models": [self._card(e).listed() for e in self.served.entries()]}

    async def show(self, body: ShowRequest) -> dict:
        entries = self.served.entries()
        name = served_name([e.name for e in entries], body.model or body.name)
        entry = next(e for e in entries if e.name == name)
        return self._card(entry).shown()

    async def ps(self) -> dict:
        """The models loaded now, each with the time it unloads if it stays idle."""
        return {"models": [self._card(e).running(e.expires_at) for e in self.served.entries() if e.state == "loaded"]}

    async def version(self) -> dict:
        return {"version": OLLAMA_API_VERSION}


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return {}  # cut by num_predict before the arguments were whole


class _Shape:
    """Ollama's objects for one reply: a piece (``done: false``) per event, then the last one with the stats."""

    def __init__(self, run: ChatRun, name: str, chat: bool, keep_thinking: bool, started: int) -> None:
        self.run, self.name, self.chat, self.keep_thinking, self.started = run, name, chat, keep_thinking, started
        self.first_token: int | None = None

    def piece(self, delta: ReplyDelta, calls: list[tuple[str, str]] = (), done: bool = False) -> dict:
        """One object of the reply: ``delta``'s text, and ``calls`` (name, arguments) whole."""
        thinking = delta.reasoning if self.keep_thinking else ""
        if self.chat:
            message = {"role": "assistant", "content": delta.content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [{"function": {"name": name, "arguments": _arguments(args)}}
                                         for name, args in calls]
            body = {"message": message}
        else:
            body = {"response": delta.content, **({"thinking": thinking} if thinking else {})}
        return {"model": self.name, "created_at": now(), **body, "done": done}

    def final(self, delta: ReplyDelta, calls: list[tuple[str, str]], finish_reason: str | None,
              tokens: int) -> dict:
        end = time.monotonic_ns()
        first = self.first_token or end
        stats = {"done_reason": DONE_REASONS.get(finish_reason, "stop"), "total_duration": end - self.started,
                 "load_duration": 0, "prompt_eval_count": self.run.prompt_tokens,
                 "prompt_eval_duration": first - self.started, "eval_count": tokens, "eval_duration": end - first}
        out = {**self.piece(delta, calls, done=True), **stats}
        if not self.chat:
            out["context"] = [*self.run.prompt_ids, *(self.run.token_ids[0] if self.run.token_ids else [])]
        return out


async def _lines(shape: _Shape) -> AsyncIterator[str]:
    """The NDJSON stream: text as it comes; the calls whole, in one object when the reply ends (Ollama sends a call
    in one piece), then the last object with the stats."""
    calls: dict[int, list] = {}  # a call's index -> [name, arguments so far], until the reply ends
    finish, tokens = None, 0
    async for event in shape.run.events():
        if shape.first_token is None:
            shape.first_token = time.monotonic_ns()
        tokens = event.num_tokens
        for c in event.delta.tool_calls:
            if c.id is not None:
                calls[c.index] = [c.name, c.arguments]
            else:
                calls[c.index][1] += c.arguments
        if event.delta.reasoning or event.delta.content:
            yield _line(shape.piece(ReplyDelta(event.delta.reasoning, event.delta.content)))
        finish = event.finish_reason or finish
    if calls:
        yield _line(shape.piece(ReplyDelta(), [tuple(c) for c in calls.values()]))
    yield _line(shape.final(ReplyDelta(), [], finish, tokens))


def install_ollama_routes(app: FastAPI, served: ModelRouter) -> None:
    """Each route is an ``OllamaService`` method: FastAPI reads the body and the request from its parameters."""
    service = OllamaService(served)
    app.add_api_route("/api/chat", service.chat, methods=["POST"])
    app.add_api_route("/api/generate", service.generate, methods=["POST"])
    app.add_api_route("/api/tags", service.tags, methods=["GET"])
    app.add_api_route("/api/show", service.show, methods=["POST"])
    app.add_api_route("/api/ps", service.ps, methods=["GET"])
    app.add_api_route("/api/version", service.version, methods=["GET"])
