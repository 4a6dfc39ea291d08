"""POST /v1/completions: text or token-id prompts (or a batch of them), streaming or not."""

from __future__ import annotations

import dataclasses
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from conveyor.core.outputs import TokenLogprobs
from conveyor.engine.engine_client import EngineInfo, Prepare
from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.server.errors import bad_request, from_value_error
from conveyor.server.protocol import CompletionRequest
from conveyor.server.serving_common import (
    ServingContext, StreamUsage, check_context, json_logprob, merged, new_id, sse_events, token_usage, usage,
)


def _prompts(prompt) -> list[str | list[int]]:
    """One prompt, or a batch: a list of strings or of token-id lists."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    return list(prompt)


def _prepare(prompt: str | list[int], max_tokens: int | None, add_special_tokens: bool) -> Prepare:
    def prepare(info: EngineInfo) -> dict:  # off the event loop, before the add (see ServingContext.submit)
        if isinstance(prompt, str):
            ids = info.encode(prompt, add_special_tokens=add_special_tokens)
            text = prompt
        else:
            ids, text = list(prompt), None
        check_context(len(ids), max_tokens, info.max_model_len)
        return {"prompt": text, "prompt_token_ids": ids}

    return prepare


def _logprobs(tokenizer, entries: list[tuple[int, TokenLogprobs | None]], text_start: int) -> dict:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset. An entry without
    logprobs (the first prompt token, under echo) gets None, as in OpenAI's and vLLM's answers."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_start
    for token_id, e in entries:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if e is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(json_logprob(e.logprob))
        top = {tokenizer.decode([t], skip_special_tokens=False): json_logprob(lp) for t, lp in e.top}
        top.setdefault(token, json_logprob(e.logprob))  # vLLM includes the sampled token
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _prompt_logprobs(tokenizer, out: RequestOutput) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    holding the prompt token and the top alternatives."""
    result: list[dict | None] = []
    for token_id, e in zip(out.prompt_token_ids, out.prompt_logprobs):
        if e is None:
            result.append(None)
            continue
        entry = {str(t): {"logprob": json_logprob(lp), "rank": r + 1,
                          "decoded_token": tokenizer.decode([t], skip_special_tokens=False)}
                 for r, (t, lp) in enumerate(e.top)}
        entry[str(token_id)] = {"logprob": json_logprob(e.logprob), "rank": e.rank,
                                "decoded_token": tokenizer.decode([token_id], skip_special_tokens=False)}
        result.append(entry)
    return result


def _choice(index: int, text: str, c: CompletionOutput, logprobs: dict | None, finished: bool) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": c.finish_reason if finished else None,
            "stop_reason": c.stop_reason if finished else None}


class _Echo:
    """What ``echo`` (and ``prompt_logprobs``) put in front of a choice: the prompt's text, its tokens' logprobs.
    ``prompt_only``: max_tokens 0 with echo, run as one generated token that is never shown (legacy OpenAI)."""

    def __init__(self, body: CompletionRequest, prompt_only: bool) -> None:
        self.echo, self.want_logprobs, self.prompt_only = body.echo, body.logprobs is not None, prompt_only
        self.want_prompt_logprobs = body.prompt_logprobs is not None

    def text(self, tokenizer, out: RequestOutput) -> str:
        if not self.echo:
            return ""
        return out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)

    def choice(self, tokenizer, out: RequestOutput, index: int, text: str, c: CompletionOutput,
               entries: list[TokenLogprobs] | None, first: bool, finished: bool, text_start: int = 0) -> dict:
        """A choice (or a stream chunk of one). ``first``: the first one of this choice, which carries the echo;
        ``text_start``: where ``text`` starts in the completion's text (for text_offset)."""
        if self.prompt_only:
            text, entries = "", []
        prompt_text = self.text(tokenizer, out)
        prefix = prompt_text if first else ""
        lp = None
        if self.want_logprobs:
            if first and self.echo:  # offsets count from the start of the echoed prompt
                head, start = list(zip(out.prompt_token_ids, out.prompt_logprobs)), 0
            else:
                head, start = [], len(prompt_text) + text_start
            lp = _logprobs(tokenizer, head + [(e.token_id, e) for e in entries or []], start)
        choice = _choice(index, prefix + text, c, lp, finished)
        if first and self.want_prompt_logprobs:
            choice["prompt_logprobs"] = _prompt_logprobs(tokenizer, out)
        return choice


async def create_completion(body: CompletionRequest, raw: Request, ctx: ServingContext, tokenizer):
    ctx.check_model(body.model)
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    prompt_only = body.echo and body.max_tokens == 0  # score the prompt, generate nothing
    max_tokens = 1 if prompt_only else body.max_tokens
    params = ctx.sampling_params(body, max_tokens, body.logprobs)
    await ctx.check_constraint(params, body.constraint_field)
    # echo with logprobs needs the prompt tokens' logprobs, as many alternatives as the completion's
    want = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        want = max(want or 0, body.logprobs)
    try:
        params = dataclasses.replace(params, prompt_logprobs=want)  # validated again: a bad count is a 400
    except ValueError as exc:
        raise from_value_error(exc) from exc
    echo = _Echo(body, prompt_only)
    given = _prompts(body.prompt)
    ctx.check_size(params, len(given))
    for i, p in enumerate(given):
        if isinstance(p, str):
            ctx.check_prompt_chars(len(p), "prompt", "prompt" if len(given) == 1 else f"prompt {i}")
    prompts = [_prepare(p, max_tokens, body.add_special_tokens) for p in given]
    request_id = new_id("cmpl")
    created = int(time.time())
    streams = await ctx.submit(request_id, prompts, params, raw, body.service_tier)
    head = {"id": request_id, "object": "text_completion", "created": created, "model": ctx.model_name}
    n = params.n

    if body.stream:
        chunks = _stream(head, streams, tokenizer, n, StreamUsage(body), echo)
        return StreamingResponse(sse_events(chunks, ctx, streams), media_type="text/event-stream")

    finals = await ctx.wait_final(streams, raw)
    choices = []
    for p, out in enumerate(finals):
        for c in out.outputs:
            choices.append(echo.choice(tokenizer, out, p * n + c.index, c.text, c, c.logprobs, True, True))
    return JSONResponse({**head, "choices": choices, "usage": usage(finals, prompt_only)})


async def _stream(head, streams, tokenizer, n: int, stream_usage: StreamUsage, echo: _Echo):
    """The chunks of a streamed completion (``sse_events`` sends them), one per delta of a choice."""
    started: set[int] = set()  # choices whose first chunk (the one carrying the echo) has gone
    prompt_tokens: dict[int, int] = {}
    async for p, out in merged(streams):
        prompt_tokens[p] = len(out.prompt_token_ids)
        for c in out.outputs:
            index = p * n + c.index
            first = index not in started
            started.add(index)
            choice = echo.choice(tokenizer, out, index, c.text, c, c.logprobs, first, c.finished, c.text_start)
            generated = 0 if echo.prompt_only else c.num_tokens
            yield {**head, "choices": [choice], **stream_usage.of_chunk(len(out.prompt_token_ids), generated)}
    if stream_usage.final:
        generated = 0 if echo.prompt_only else sum(s.num_generated_tokens for s in streams)
        yield {**head, "choices": [], "usage": token_usage(sum(prompt_tokens.values()), generated)}
