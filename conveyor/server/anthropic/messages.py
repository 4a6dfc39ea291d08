"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's wire format over the one chat path.

A reply is content blocks: ``thinking`` (when the client enabled thinking and the model reasons), ``text``, then
one ``tool_use`` per call. Streamed, it is Anthropic's event sequence: ``message_start``, ``ping``, then per block
``content_block_start`` / ``content_block_delta`` (``thinking_delta`` and a ``signature_delta``, ``text_delta``,
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (``stop_reason``, ``stop_sequence``,
``usage.output_tokens``) and ``message_stop``; an error after the headers is an ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from conveyor.server.anthropic.protocol import CountTokensRequest, MessagesRequest, chat_body
from conveyor.server.chat_plan import check_plan, internal_request, plan_chat
from conveyor.server.chat_run import ChatRun
from conveyor.server.errors import APIError, anthropic_error
from conveyor.server.reply import ReplyResult
from conveyor.server.reply_blocks import Block, BlockEvent, BlockSequencer
from conveyor.server.served_models import ModelRouter
from conveyor.server.serving_common import ServingContext, guarded_stream

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def stop_reason(finish_reason: str | None, stop: int | str | None) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence that ended the reply)."""
    if finish_reason == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return STOP_REASONS.get(finish_reason, "end_turn"), None


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}  # cut by max_tokens: the arguments as far as written are not an object yet
    return value if isinstance(value, dict) else {}


def _content(r: ReplyResult, thinks: bool) -> list[dict]:
    content = []
    if thinks and r.reasoning:
        content.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
    if r.content:
        content.append({"type": "text", "text": r.content})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _tool_input(c.arguments)}
                for c in r.tool_calls]
    return content


def _message(run: ChatRun, model: str, content: list[dict], stop: tuple[str | None, str | None],
             output_tokens: int) -> dict:
    return {"id": run.request_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": run.prompt_tokens, "output_tokens": output_tokens}}


async def create_message(body: MessagesRequest, raw: Request, ctx: ServingContext):
    plan = await check_plan(plan_chat(internal_request(chat_body(body)), ctx), ctx)
    run = await plan.submit(ctx, raw, prefix="msg")
    if body.stream:
        frames = _stream(run, body.model, body.thinks)
        return StreamingResponse(guarded_stream(frames, ctx, run.streams, _error_event),
                                 media_type="text/event-stream")
    (result,) = await run.results(raw)
    return JSONResponse(_message(run, body.model, _content(result, body.thinks),
                                 stop_reason(result.finish_reason, result.stop_reason), result.num_tokens))


def _error_event(error: APIError) -> str:
    return event("error", anthropic_error(error))


def _block_start(block: Block) -> dict:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}


def _block_events(e: BlockEvent) -> list[str]:
    index = e.block.index
    if e.what == "start":
        return [event("content_block_start", {"type": "content_block_start", "index": index,
                                              "content_block": _block_start(e.block)})]
    if e.what == "delta":
        kind = e.block.kind
        delta = ({"type": "thinking_delta", "thinking": e.text} if kind == "reasoning" else
                 {"type": "text_delta", "text": e.text} if kind == "text" else
                 {"type": "input_json_delta", "partial_json": e.text})
        return [event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})]
    frames = []
    if e.block.kind == "reasoning":  # Anthropic closes a thinking block with its signature (none here)
        frames.append(event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                    "delta": {"type": "signature_delta", "signature": ""}}))
    return [*frames, event("content_block_stop", {"type": "content_block_stop", "index": index})]


async def _stream(run: ChatRun, model: str, thinks: bool) -> AsyncIterator[str]:
    start = _message(run, model, [], (None, None), 0)
    yield event("message_start", {"type": "message_start", "message": start})
    yield event("ping", {"type": "ping"})
    blocks = BlockSequencer(keep_reasoning=thinks)
    stop, tokens = ("end_turn", None), 0
    async for choice in run.events():
        tokens = choice.num_tokens
        for e in blocks.feed(choice.delta):
            for frame in _block_events(e):
                yield frame
        if choice.finish_reason is not None:
            stop = stop_reason(choice.finish_reason, choice.stop_reason)
    for e in blocks.close():
        for frame in _block_events(e):
            yield frame
    yield event("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                  "usage": {"output_tokens": tokens}})
    yield event("message_stop", {"type": "message_stop"})


async def count_tokens(body: CountTokensRequest, ctx: ServingContext) -> dict:
    plan = plan_chat(internal_request(chat_body(body)), ctx)
    ids, _ = await ctx.tokenizer_call(lambda info: plan.render(info, ctx, check_length=False))
    return {"input_tokens": len(ids)}


def install_anthropic_routes(app: FastAPI, served: ModelRouter) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, raw: Request):
        return await create_message(body, raw, await served.resolve(body.model, "generate"))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest):
        return await count_tokens(body, await served.resolve(body.model, "generate"))
