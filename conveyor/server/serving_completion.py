"""POST /v1/completions: text or token-id prompts (or a batch of them), streaming or not."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from conveyor.core.outputs import TokenLogprobs
from conveyor.engine.outputs import CompletionOutput
from conveyor.server.errors import bad_request
from conveyor.server.protocol import CompletionRequest
from conveyor.server.serving_common import (
    DeltaTracker, ServingContext, check_context, merged, new_id, sse_events, usage,
)


def _prompts(prompt) -> list[str | list[int]]:
    """One prompt, or a batch: a list of strings or of token-id lists."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    return list(prompt)


def _prepare(prompt: str | list[int], max_tokens: int | None, add_special_tokens: bool):
    def prepare(engine) -> dict:  # runs on the engine thread
        if isinstance(prompt, str):
            ids = engine.encode(prompt, add_special_tokens=add_special_tokens)
            text = prompt
        else:
            ids, text = list(prompt), None
        check_context(len(ids), max_tokens, engine.max_model_len)
        return {"prompt": text, "prompt_token_ids": ids}

    return prepare


def _logprobs(tokenizer, entries: list[TokenLogprobs], text_start: int) -> dict:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_start
    for e in entries:
        token = tokenizer.decode([e.token_id], skip_special_tokens=False)
        tokens.append(token)
        token_logprobs.append(e.logprob)
        top = {tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in e.top}
        top.setdefault(token, e.logprob)  # vLLM includes the sampled token
        tops.append(top)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _choice(index: int, text: str, c: CompletionOutput, logprobs: dict | None, finished: bool) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": c.finish_reason if finished else None,
            "stop_reason": c.stop_reason if finished else None}


async def create_completion(body: CompletionRequest, raw: Request, ctx: ServingContext, tokenizer):
    ctx.check_model(body.model)
    if body.echo:
        raise bad_request("echo is not supported", "echo")
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    params = ctx.sampling_params(body, body.max_tokens, body.logprobs)
    prompts = [_prepare(p, body.max_tokens, body.add_special_tokens) for p in _prompts(body.prompt)]
    ctx.check_size(params, len(prompts))
    request_id = new_id("cmpl")
    created = int(time.time())
    streams = await ctx.submit(request_id, prompts, params)
    head = {"id": request_id, "object": "text_completion", "created": created, "model": ctx.model_name}
    n = params.n

    if body.stream:
        chunks = _stream(head, streams, tokenizer, params, n, body.include_usage)
        return StreamingResponse(sse_events(chunks, ctx, streams), media_type="text/event-stream")

    finals = await ctx.wait_final(streams, raw)
    choices = []
    for p, out in enumerate(finals):
        for c in out.outputs:
            lp = _logprobs(tokenizer, c.logprobs, 0) if c.logprobs is not None else None
            choices.append(_choice(p * n + c.index, c.text, c, lp, True))
    return JSONResponse({**head, "choices": choices, "usage": usage(finals)})


async def _stream(head, streams, tokenizer, params, n: int, include_usage: bool):
    """The chunks of a streamed completion (``sse_events`` sends them)."""
    tracker = DeltaTracker(params)
    last = {}
    async for p, out in merged(streams):
        last[p] = out
        for c in out.outputs:
            index = p * n + c.index
            delta = tracker.delta(index, c)
            if delta is None:
                continue
            text, t0, t1, finished = delta
            lp = None
            if c.logprobs is not None:
                lp = _logprobs(tokenizer, c.logprobs[t0:t1], tracker.chars[index] - len(text))
            chunk = {**head, "choices": [_choice(index, text, c, lp, finished)]}
            if include_usage:
                chunk["usage"] = None
            yield chunk
    if include_usage:
        yield {**head, "choices": [], "usage": usage(list(last.values()))}
