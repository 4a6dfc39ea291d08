"""POST /v1/chat/completions: messages through the model's chat template, streaming or not."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from conveyor.core.outputs import TokenLogprobs
from conveyor.engine import chat
from conveyor.server.errors import APIError, bad_request, from_engine_error, from_value_error
from conveyor.server.protocol import ChatCompletionRequest, ChatMessage
from conveyor.server.serving_common import (
    SSE_DONE, DeltaTracker, ServingContext, check_context, merged, new_id, sse, usage,
)


def messages_as_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Plain {"role", "content"} dicts for the template; content parts other than text are refused."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise bad_request(f"messages[{i}]: only text content parts are supported, got "
                                      f"{part.get('type')!r}", "messages")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        out.append({"role": m.role, "content": content or "", **({"name": m.name} if m.name else {})})
    return out


def render_chat(engine, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool) -> list[int]:
    """Token ids of a conversation through the model's chat template (engine thread)."""
    return chat.render_chat(engine.tokenizer, messages, add_generation_prompt, add_special_tokens=add_special_tokens)


def _logprobs(tokenizer, entries: list[TokenLogprobs]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


async def create_chat_completion(body: ChatCompletionRequest, raw: Request, ctx: ServingContext, tokenizer):
    ctx.check_model(body.model)
    if body.tools:
        raise bad_request("tools are not supported", "tools")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise bad_request("only response_format {\"type\": \"text\"} is supported", "response_format")
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    try:
        params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    except ValueError as exc:
        raise from_value_error(exc) from exc
    messages = messages_as_dicts(body.messages)

    def prepare(engine) -> dict:  # engine thread
        ids = render_chat(engine, messages, body.add_generation_prompt, body.add_special_tokens)
        check_context(len(ids), max_tokens, engine.max_model_len)
        return {"prompt_token_ids": ids}

    request_id = new_id("chatcmpl")
    streams = await ctx.submit(request_id, [prepare], params)
    head = {"id": request_id, "created": int(time.time()), "model": ctx.model_name}
    if body.stream:
        return StreamingResponse(_stream(head, streams, ctx, tokenizer, params, body.include_usage),
                                 media_type="text/event-stream")

    (final,) = await ctx.wait_final(streams, raw)
    choices = [{
        "index": c.index,
        "message": {"role": "assistant", "content": c.text},
        "logprobs": _logprobs(tokenizer, c.logprobs) if c.logprobs is not None else None,
        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
    } for c in final.outputs]
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": usage([final])})


async def _stream(head, streams, ctx: ServingContext, tokenizer, params, include_usage: bool):
    head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}
    tracker = DeltaTracker(params)
    final = None
    try:
        # OpenAI sends the role first, in a chunk of its own per choice.
        for i in range(params.n):
            choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            yield sse({**head, "choices": [choice], **extra})
        async for _, out in merged(streams):
            final = out
            for c in out.outputs:
                delta = tracker.delta(c.index, c)
                if delta is None:
                    continue
                text, t0, t1, finished = delta
                choice = {
                    "index": c.index, "delta": {"content": text} if text or not finished else {},
                    "logprobs": _logprobs(tokenizer, c.logprobs[t0:t1]) if c.logprobs is not None else None,
                    "finish_reason": c.finish_reason if finished else None,
                    "stop_reason": c.stop_reason if finished else None,
                }
                yield sse({**head, "choices": [choice], **extra})
        if include_usage and final is not None:
            yield sse({**head, "choices": [], "usage": usage([final])})
    except Exception as exc:  # headers are sent: report in-band, as vLLM does
        error = exc if isinstance(exc, APIError) else from_engine_error(exc)
        yield sse(error.body())
    finally:
        ctx.abort(streams)
    yield SSE_DONE
