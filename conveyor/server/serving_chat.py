"""POST /v1/chat/completions: messages through the model's chat template, streaming or not."""

from __future__ import annotations

import dataclasses
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from conveyor.core.outputs import TokenLogprobs
from conveyor.engine import chat
from conveyor.engine.engine_client import EngineInfo
from conveyor.server.errors import bad_request
from conveyor.server.protocol import ChatCompletionRequest, ChatMessage
from conveyor.server.serving_common import (
    DeltaTracker, ServingContext, StreamUsage, check_context, json_logprob, merged, new_id, sse_events, usage,
)
from conveyor.server.tools import ToolCall, ToolPlan, messages_for_tools, plan_tools


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


def generation_prompt(body) -> bool:
    """Whether the template adds the generation prompt (the assistant's header) for ``body`` (a chat or tokenize
    request). vLLM's rule: ``continue_final_message`` leaves the final message open, so no new one starts; an
    explicit ``add_generation_prompt: true`` with it is a 400 (its default, true, yields)."""
    if not body.continue_final_message:
        return body.add_generation_prompt
    if body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          "continue_final_message")
    return False


def response_role(messages: list[dict], add_generation_prompt: bool) -> str:
    """The role of the message the model writes, as vLLM's ``get_chat_request_role``: a new assistant message
    after a generation prompt, else more of the final message, in its role."""
    return "assistant" if add_generation_prompt else messages[-1]["role"]


def echoed(body, messages: list[dict], role: str) -> str:
    """What ``echo`` puts in front of each reply, as vLLM does: the final message's text when its role is the
    reply's (``response_role``): always when the reply continues it (``continue_final_message``, or
    ``add_generation_prompt: false``), and after a generation prompt when it is an assistant message; a reply to
    the user's message does not start with the user's words."""
    return messages[-1]["content"] if body.echo and messages[-1]["role"] == role else ""


def _logprobs(tokenizer, entries: list[TokenLogprobs]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": json_logprob(logprob), "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


async def create_chat_completion(body: ChatCompletionRequest, raw: Request, ctx: ServingContext, tokenizer):
    ctx.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = ctx.sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    plan, params = _plan_tools(body, ctx, tokenizer, params)
    await ctx.check_constraint(params, body.constraint_field or "tool_choice")
    ctx.check_size(params, 1)
    messages = messages_for_tools(messages_as_dicts(body.messages), plan, body.messages)
    add_generation_prompt = generation_prompt(body)
    role = response_role(messages, add_generation_prompt)
    echo = echoed(body, messages, role)
    # The template adds its own markup around the messages and keeps their text, so the text alone bounds the
    # prompt from below.
    ctx.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages", "the messages' text")

    prompt_tokens = []  # prepare's count, for the chunks streamed before the first output (every ServedEngine
    # runs prepare in this process before add_request returns)

    def prepare(info: EngineInfo) -> dict:  # off the event loop, before submit returns
        ids = chat.render_chat(info.tokenizer, messages, add_generation_prompt,
                               add_special_tokens=body.add_special_tokens,
                               continue_final_message=body.continue_final_message,
                               tools=plan.template_tools if plan is not None else None)
        check_context(len(ids), max_tokens, info.max_model_len)
        prompt_tokens.append(len(ids))
        return {"prompt_token_ids": ids}

    request_id = new_id("chatcmpl")
    streams = await ctx.submit(request_id, [prepare], params, raw)
    head = {"id": request_id, "created": int(time.time()), "model": ctx.model_name}
    if body.stream:
        chunks = _stream(head, streams, tokenizer, params, StreamUsage(body), prompt_tokens[0], role, echo, plan)
        return StreamingResponse(sse_events(chunks, ctx, streams), media_type="text/event-stream")

    (final,) = await ctx.wait_final(streams, raw)
    choices = []
    for c in final.outputs:
        message, finish_reason = _reply(echo + c.text, c.finish_reason, plan, role)
        choices.append({"index": c.index, "message": message,
                        "logprobs": _logprobs(tokenizer, c.logprobs) if c.logprobs is not None else None,
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason})
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": usage([final])})


def _plan_tools(body: ChatCompletionRequest, ctx: ServingContext, tokenizer, params):
    """The request's tool plan and its params, constrained when the plan says so (400 when malformed)."""
    try:
        choice = body.tool_choice if body.tool_choice is None or isinstance(body.tool_choice, str) else \
            body.tool_choice.model_dump()
        plan = plan_tools(body.tools, choice, body.parallel_tool_calls, ctx.tool_call_parser,
                          tokenizer.chat_template)
    except ValueError as exc:
        raise bad_request(str(exc), "tool_choice" if "tool_choice" in str(exc) else "tools") from exc
    if plan is None or plan.constraint is None:
        return plan, params
    if params.structured_outputs is not None:
        raise bad_request(f"tool_choice {plan.mode!r} constrains the reply to tool calls: it cannot be combined "
                          "with response_format or structured_outputs", "tool_choice")
    try:
        return plan, dataclasses.replace(params, structured_outputs=plan.constraint)
    except ValueError as exc:
        raise bad_request(str(exc), "tool_choice") from exc


def _reply(text: str, finish_reason: str | None, plan: ToolPlan | None,
           role: str = "assistant") -> tuple[dict, str | None]:
    """The message of a finished choice (its tool calls parsed out) and its finish reason."""
    if plan is None:
        return {"role": role, "content": text}, finish_reason
    content, calls = plan.parse(text)
    if not calls:
        return {"role": role, "content": content}, finish_reason
    message = {"role": role, "content": content, "tool_calls": [c.as_openai() for c in calls]}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


async def _stream(head, streams, tokenizer, params, stream_usage: StreamUsage, prompt_tokens: int, role: str,
                  echo: str, plan: ToolPlan | None = None):
    """The chunks of a streamed chat completion (``sse_events`` sends them). With tools, as OpenAI's
    ``delta.tool_calls``: a named tool_choice's arguments stream as they are written; any other reply is sent
    whole when it finishes (its text must be complete to tell a tool call from an answer)."""
    head = {**head, "object": "chat.completion.chunk"}
    extra = stream_usage.of_chunk(prompt_tokens, 0)  # of the chunks before the first generated token
    tracker = DeltaTracker(params)
    call_ids: dict[int, str] = {}  # choice -> the id of its streamed call (a named tool_choice)
    final = None
    # OpenAI sends the role first, in a chunk of its own per choice.
    for i in range(params.n):
        choice = {"index": i, "delta": {"role": role, "content": ""}, "logprobs": None,
                  "finish_reason": None}
        yield {**head, "choices": [choice], **extra}
    # vLLM sends the echo next, in a chunk of its own per choice, before anything is generated.
    for i in range(params.n if echo else 0):
        choice = {"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}
        yield {**head, "choices": [choice], **extra}
    async for _, out in merged(streams):
        final = out
        for c in out.outputs:
            delta = tracker.delta(c.index, c)
            if delta is None:
                continue
            text, t0, t1, finished = delta
            if plan is not None and plan.parser == "named":  # the arguments stream as they are written
                first = c.index not in call_ids
                call_ids.setdefault(c.index, ToolCall(plan.named, "").id)
                call = {"index": 0, "function": {"arguments": text}}
                if first:
                    call = {"index": 0, "id": call_ids[c.index], "type": "function",
                            "function": {"name": plan.named, "arguments": text}}
                choice = {"index": c.index, "delta": {"tool_calls": [call]} if text or first else {},
                          "logprobs": None, "finish_reason": ("tool_calls" if c.finish_reason == "stop"
                                                              else c.finish_reason) if finished else None}
                yield {**head, "choices": [choice], **stream_usage.of_chunk(prompt_tokens, len(c.token_ids))}
                continue
            if plan is not None:
                if finished:
                    yield {**head, "choices": [_tool_chunk(c, plan)],
                           **stream_usage.of_chunk(prompt_tokens, len(c.token_ids))}
                continue
            choice = {
                "index": c.index, "delta": {"content": text} if text or not finished else {},
                "logprobs": _logprobs(tokenizer, c.logprobs[t0:t1]) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason if finished else None,
                "stop_reason": c.stop_reason if finished else None,
            }
            yield {**head, "choices": [choice], **stream_usage.of_chunk(prompt_tokens, len(c.token_ids))}
    if stream_usage.final and final is not None:
        yield {**head, "choices": [], "usage": usage([final])}


def _tool_chunk(c, plan: ToolPlan) -> dict:
    """The one chunk of a finished choice of a request with tools: its content or its tool calls."""
    message, finish_reason = _reply(c.text, c.finish_reason, plan)
    delta = {"content": message["content"]} if message["content"] else {}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    return {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": c.stop_reason}
