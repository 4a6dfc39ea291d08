"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}`` (and its ``/input_items``): the OpenAI
Responses API over the one chat path, with past responses in a ``ResponseStore``.

A reply is output items: a ``reasoning`` item (its text as ``reasoning_text`` content) when the model reasons, a
``message`` with one ``output_text`` part, one ``function_call`` item per call. Streamed, it is the Responses event
sequence, each event numbered (``sequence_number``): ``response.created``, ``response.in_progress``, per item
``response.output_item.added``, its parts and deltas (``response.reasoning_text.delta``,
``response.content_part.added`` / ``response.output_text.delta`` / ``.done`` / ``response.content_part.done``,
``response.function_call_arguments.delta`` / ``.done``), ``response.output_item.done``, then
``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``); an error after the headers is
an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from conveyor.server.auth import key_scope
from conveyor.server.chat_plan import check_plan, internal_request, plan_chat
from conveyor.server.chat_run import ChatRun
from conveyor.server.errors import APIError
from conveyor.server.reply import ReplyResult
from conveyor.server.reply_blocks import Block, BlockEvent, BlockSequencer
from conveyor.server.responses.protocol import (
    ResponsesRequest, chat_body, conversation, input_items, namespaces, output_conversation, split_name,
)
from conveyor.server.responses.store import ResponseStore
from conveyor.server.served_models import ModelRouter
from conveyor.server.serving_common import guarded_stream


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def not_found(response_id: str, param: str | None = None, code: str = "response_not_found") -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", param, code)


class ResponseShape:
    """The response object of one request, as it grows: its fields echo the request's settings."""

    def __init__(self, body: ResponsesRequest, run: ChatRun, model: str) -> None:
        self.body, self.run = body, run
        self.id = _id("resp")
        self.head = {
            "id": self.id, "object": "response", "created_at": run.created, "model": model,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": (body.text.format if body.text and body.text.format else {"type": "text"})},
            "tool_choice": body.tool_choice or "auto", "tools": [_tool_echo(t) for t in body.tools or []],
            "truncation": "disabled",
            "user": body.user, "error": None, "incomplete_details": None, "background": False}

    @property
    def keeps_reasoning(self) -> bool:
        """Reasoning comes back as a reasoning item unless the client turned thinking off (effort "none")."""
        return not (self.body.reasoning is not None and self.body.reasoning.effort == "none")

    def whole(self, status: str, output: list[dict], output_tokens: int, finish_reason: str | None = None) -> dict:
        usage = {"input_tokens": self.run.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": self.run.prompt_tokens + output_tokens}
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        status = "incomplete" if incomplete and status == "completed" else status
        return {**self.head, "status": status, "incomplete_details": incomplete, "output": output,
                "usage": usage if status != "in_progress" else None}


def _tool_echo(tool: dict) -> dict:
    if tool.get("type") == "namespace":
        return tool
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _part(kind: str, text: str) -> dict:
    return _text_part(text) if kind == "text" else {"type": "reasoning_text", "text": text}


def _message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)] if text is not None else []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed",
               spaces: set[str] = frozenset()) -> dict:
    namespace, name = split_name(name, spaces)
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status, **({"namespace": namespace} if namespace else {})}


def output_items(r: ReplyResult, keep_reasoning: bool = True, spaces: set[str] = frozenset()) -> list[dict]:
    items = []
    if r.reasoning and keep_reasoning:
        items.append(_reasoning_item(_id("rs"), r.reasoning))
    if r.content or not r.tool_calls:  # a reply with neither text nor calls has its empty message
        items.append(_message_item(_id("msg"), r.content))
    items += [_call_item(_id("fc"), c.id, c.name, c.arguments, spaces=spaces) for c in r.tool_calls]
    return items


class ResponsesService:
    """The routes' work: requests planned from their body and the store, replies shaped, responses stored."""

    def __init__(self, served: ModelRouter, store: ResponseStore) -> None:
        self.served, self.store = served, store

    async def create(self, body: ResponsesRequest, raw: Request):
        scope = key_scope(raw)
        earlier: list[dict] = []
        if body.previous_response_id is not None:
            stored = await asyncio.to_thread(self.store.get, scope, body.previous_response_id)
            if stored is None:
                raise not_found(body.previous_response_id, "previous_response_id", "previous_response_not_found")
            earlier = stored.conversation
        items = input_items(body)
        messages = conversation(items, earlier)
        ctx = await self.served.resolve(body.model, "generate")
        plan = await check_plan(plan_chat(internal_request(chat_body(body, messages)), ctx), ctx)
        run = await plan.submit(ctx, raw, prefix="resp")
        shape = ResponseShape(body, run, body.model or ctx.model_name)

        async def keep(response: dict, reply: dict) -> None:
            """Store a finished response (``store: true``), with the conversation a follow-up continues."""
            if body.store and response["status"] in ("completed", "incomplete"):
                await asyncio.to_thread(self.store.put, scope, response, items, [*messages, reply])

        if body.stream:
            frames = _stream(shape, run, keep)
            return StreamingResponse(guarded_stream(frames, ctx, run.streams, _error_frame),
                                     media_type="text/event-stream")
        (result,) = await run.results(raw)
        output = output_items(result, shape.keeps_reasoning, namespaces(body))
        response = shape.whole("completed", output, result.num_tokens, result.finish_reason)
        await keep(response, output_conversation(result.content, [(c.id, c.name, c.arguments)
                                                                   for c in result.tool_calls]))
        return JSONResponse(response)

    async def get(self, response_id: str, raw: Request) -> dict:
        stored = await asyncio.to_thread(self.store.get, key_scope(raw), response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.response

    async def input_items(self, response_id: str, raw: Request) -> dict:
        stored = await asyncio.to_thread(self.store.get, key_scope(raw), response_id)
        if stored is None:
            raise not_found(response_id)
        data = [{"id": item.get("id") or _id("item"), **item} for item in stored.input_items]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": False}

    async def delete(self, response_id: str, raw: Request) -> dict:
        if not await asyncio.to_thread(self.store.delete, key_scope(raw), response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _error_frame(error: APIError) -> str:
    return _sse({"type": "error", "code": error.code, "message": error.message, "param": error.param,
                 "sequence_number": 0})


def _sse(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


class _EventWriter:
    """Numbers the events of one stream and writes the item events of its blocks."""

    def __init__(self, spaces: set[str]) -> None:
        self.spaces = spaces  # the request's tool namespaces
        self.seq = 0
        self.items: dict[int, dict] = {}  # block index -> the item it became (its id, and its whole form at the end)

    def __call__(self, kind: str, **fields) -> str:
        frame = _sse({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return frame

    def block(self, e: BlockEvent) -> list[str]:
        b, at = e.block, e.block.index
        if e.what == "start":
            item = self._item(b, "in_progress")
            self.items[at] = item
            frames = [self("response.output_item.added", output_index=at, item=item)]
            if b.kind != "tool_call":
                frames.append(self("response.content_part.added", item_id=item["id"], output_index=at,
                                   content_index=0, part=_part(b.kind, "")))
            return frames
        item_id = self.items[at]["id"]
        if e.what == "delta":
            if b.kind == "text":
                return [self("response.output_text.delta", item_id=item_id, output_index=at, content_index=0,
                             delta=e.text, logprobs=[])]
            if b.kind == "reasoning":
                return [self("response.reasoning_text.delta", item_id=item_id, output_index=at, content_index=0,
                             delta=e.text)]
            return [self("response.function_call_arguments.delta", item_id=item_id, output_index=at, delta=e.text)]
        done = self._item(b, "completed", item_id)
        self.items[at] = done
        frames = []
        if b.kind == "text":
            frames += [self("response.output_text.done", item_id=item_id, output_index=at, content_index=0,
                            text=b.text, logprobs=[]),
                       self("response.content_part.done", item_id=item_id, output_index=at, content_index=0,
                            part=_part(b.kind, b.text))]
        elif b.kind == "reasoning":
            frames += [self("response.reasoning_text.done", item_id=item_id, output_index=at, content_index=0,
                            text=b.text),
                       self("response.content_part.done", item_id=item_id, output_index=at, content_index=0,
                            part=_part(b.kind, b.text))]
        else:
            frames.append(self("response.function_call_arguments.done", item_id=item_id, output_index=at,
                               name=done["name"], arguments=b.text))
        return [*frames, self("response.output_item.done", output_index=at, item=done)]

    def _item(self, b: Block, status: str, item_id: str | None = None) -> dict:
        if b.kind == "reasoning":
            return _reasoning_item(item_id or _id("rs"), b.text if status == "completed" else "", status)
        if b.kind == "text":
            return _message_item(item_id or _id("msg"), b.text if status == "completed" else None, status)
        return _call_item(item_id or _id("fc"), b.call_id, b.name, b.text if status == "completed" else "", status,
                          self.spaces)


async def _stream(shape: ResponseShape, run: ChatRun, keep) -> AsyncIterator[str]:
    write = _EventWriter(namespaces(shape.body))
    yield write("response.created", response=shape.whole("in_progress", [], 0))
    yield write("response.in_progress", response=shape.whole("in_progress", [], 0))
    blocks = BlockSequencer(keep_reasoning=shape.keeps_reasoning)
    finish, tokens = None, 0
    async for event in run.events():
        tokens = event.num_tokens
        for e in blocks.feed(event.delta):
            for frame in write.block(e):
                yield frame
        finish = event.finish_reason or finish
    for e in blocks.close():
        for frame in write.block(e):
            yield frame
    if not any(b.kind in ("text", "tool_call") for b in blocks.blocks):
        empty = Block(len(blocks.blocks), "text")  # a reply with neither text nor calls has its empty message
        blocks.blocks.append(empty)
        for e in (BlockEvent("start", empty), BlockEvent("stop", empty)):
            for frame in write.block(e):
                yield frame
    output = [write.items[b.index] for b in blocks.blocks]
    response = shape.whole("completed", output, tokens, finish)
    text = "".join(b.text for b in blocks.blocks if b.kind == "text")
    calls = [(b.call_id, b.name, b.text) for b in blocks.blocks if b.kind == "tool_call"]
    await keep(response, output_conversation(text, calls))
    done = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield write(done, response=response)


def install_responses_routes(app: FastAPI, served: ModelRouter, store: ResponseStore) -> None:
    """Each route is a ``ResponsesService`` method: FastAPI reads the body, the path's id and the request from its
    parameters."""
    service = ResponsesService(served, store)
    app.add_api_route("/v1/responses", service.create, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", service.get, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}/input_items", service.input_items, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", service.delete, methods=["DELETE"])
