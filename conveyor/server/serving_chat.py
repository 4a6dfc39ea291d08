"""POST /v1/chat/completions: OpenAI's wire format over the one chat path (``chat_plan.py``), streaming or not."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from conveyor.core.outputs import TokenLogprobs
from conveyor.server.chat_plan import check_plan, plan_chat
from conveyor.server.chat_run import ChatRun, ChoiceEvent
from conveyor.server.protocol import ChatCompletionRequest
from conveyor.server.reply import ReplyResult
from conveyor.server.serving_common import ServingContext, StreamUsage, json_logprob, sse_events


def logprobs_content(tokenizer, entries: list[TokenLogprobs]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": json_logprob(logprob), "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


async def create_chat_completion(body: ChatCompletionRequest, raw: Request, ctx: ServingContext, tokenizer):
    plan = await check_plan(plan_chat(body, ctx), ctx)
    run = await plan.submit(ctx, raw)
    head = {"id": run.request_id, "created": run.created, "model": ctx.model_name}
    if body.stream:
        chunks = _stream(head, run, tokenizer, StreamUsage(body))
        return StreamingResponse(sse_events(chunks, ctx, run.streams), media_type="text/event-stream")
    results = await run.results(raw)
    choices = []
    for r in results:
        choices.append({"index": r.index, "message": _message(r, plan.role, plan.echo, run.reasons),
                        "logprobs": logprobs_content(tokenizer, r.logprobs) if r.logprobs is not None else None,
                        "finish_reason": r.finish_reason, "stop_reason": r.stop_reason})
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": run.usage()})


def _message(r: ReplyResult, role: str, echo: str, reasons: bool) -> dict:
    message = {"role": role, "content": (echo + r.content) if r.content or echo or not r.tool_calls else None}
    if reasons:
        message["reasoning_content"] = r.reasoning or None
    if r.tool_calls:
        message["tool_calls"] = [c.as_openai() for c in r.tool_calls]
    return message


async def _stream(head: dict, run: ChatRun, tokenizer, stream_usage: StreamUsage):
    """The chunks of a streamed chat completion (``sse_events`` sends them): the role, the echo, then one chunk
    per event: ``delta.reasoning_content``, ``delta.content`` and ``delta.tool_calls`` as the reply is read."""
    head = {**head, "object": "chat.completion.chunk"}
    n, prompt_tokens = run.plan.params.n, run.prompt_tokens
    extra = stream_usage.of_chunk(prompt_tokens, 0)  # of the chunks before the first generated token
    # OpenAI sends the role first, in a chunk of its own per choice; vLLM the echo next, before anything generated.
    for i in range(n):
        yield {**head, "choices": [_choice(i, {"role": run.plan.role, "content": ""})], **extra}
    for i in range(n if run.plan.echo else 0):
        yield {**head, "choices": [_choice(i, {"content": run.plan.echo})], **extra}
    async for event in run.events():
        delta = _delta(event)
        if not delta and event.finish_reason is None:
            continue
        choice = _choice(event.index, delta, event)
        if event.logprobs is not None:
            choice["logprobs"] = logprobs_content(tokenizer, event.logprobs)
        yield {**head, "choices": [choice], **stream_usage.of_chunk(prompt_tokens, event.num_tokens)}
    if stream_usage.final and run.final is not None:
        yield {**head, "choices": [], "usage": run.usage()}


def _delta(event: ChoiceEvent) -> dict:
    d = event.delta
    delta: dict = {}
    if d.reasoning:
        delta["reasoning_content"] = d.reasoning
    if d.content:
        delta["content"] = d.content
    if d.tool_calls:
        delta["tool_calls"] = [{"index": c.index, **({"id": c.id, "type": "function"} if c.id else {}),
                                "function": {**({"name": c.name} if c.name else {}), "arguments": c.arguments}}
                               for c in d.tool_calls]
    return delta


def _choice(index: int, delta: dict, event: ChoiceEvent | None = None) -> dict:
    finish = event.finish_reason if event is not None else None
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = event.stop_reason
    return choice
