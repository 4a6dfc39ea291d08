"""The one internal chat request: every protocol (chat completions, Anthropic Messages, Responses, Ollama) turns its
body into a ``ChatCompletionRequest``, plans it once here (``plan_chat``: sampling params, tool plan, constraint,
reasoning, the checks) and submits the plan (``ChatRequestPlan.submit``), then reads one output stream of
``ChoiceEvent`` (``chat_run.ChatRun``): reasoning, answer text and tool calls per choice, as ``reply.py`` reads
them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastapi import Request
from pydantic import ValidationError

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine import chat
from conveyor.engine.engine_client import EngineInfo
from conveyor.engine.prompts import encode_text
from conveyor.server.chat_run import ChatRun
from conveyor.server.errors import bad_request
from conveyor.server.protocol import ChatCompletionRequest, ChatMessage
from conveyor.server.reasoning import reply_start
from conveyor.server.serving_common import ServingContext, check_context, new_id
from conveyor.server.tools import ToolPlan, answered_calls, messages_for_tools, plan_tools

# Names the template gets from conveyor itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARIABLES = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                               "chat_template"}


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


@dataclass
class ChatRequestPlan:
    """A chat request, checked and planned: what it samples with, its tools, whether replies reason, and the
    conversation the template renders. ``role``: the role of the message the model writes; ``echo``: the text
    each reply starts with (chat's ``echo``)."""

    body: ChatCompletionRequest
    params: SamplingParams
    tools: ToolPlan | None
    messages: list[dict]
    add_generation_prompt: bool
    role: str
    echo: str
    max_tokens: int | None
    template_kwargs: dict
    raw_prompt: str | None = None  # a prompt that bypasses the template (Ollama's raw generate)
    prefix_ids: tuple[int, ...] = ()  # token ids before the prompt (Ollama's generate context)

    def render(self, info: EngineInfo, ctx: ServingContext,
               check_length: bool = True) -> tuple[list[int], str | None]:
        """(prompt token ids, where a reply starts: ``reasoning.reply_start``, None for a model that does not
        reason). Runs off the event loop; ValueError (400) when the template refuses the messages or (with
        ``check_length``) the prompt does not fit with ``max_tokens``."""
        if self.raw_prompt is not None:
            text = self.raw_prompt
            ids = encode_text(info.tokenizer, text, True, field="prompt")
        else:
            text = chat.chat_prompt(info.tokenizer, self.messages, self.add_generation_prompt,
                                    continue_final_message=self.body.continue_final_message,
                                    tools=self.tools.template_tools if self.tools is not None else None,
                                    template_kwargs=self.template_kwargs)
            ids = encode_text(info.tokenizer, text, self.body.add_special_tokens, field="messages")
        ids = [*self.prefix_ids, *ids]
        if check_length:
            check_context(len(ids), self.max_tokens, info.max_model_len)
        return ids, reply_start(ctx.reasoning.syntax, text) if ctx.reasoning is not None else None

    async def submit(self, ctx: ServingContext, raw: Request, prefix: str = "chatcmpl") -> ChatRun:
        """Render the prompt (off the loop) and queue the request (a client that disconnects meanwhile aborts
        it); its output as a ``ChatRun``."""
        ids, start = await ctx.tokenizer_call(lambda info: self.render(info, ctx))
        run = ChatRun(ctx, self, new_id(prefix), ids, start, raw)
        await run.submit(self.params)
        return run


def internal_request(fields: dict) -> ChatCompletionRequest:
    """The internal chat request another protocol's adapter built (its fields in chat-completions form). The
    adapter checked its own body; what only the chat path checks (a tool's schema, a message's shape) is a 400."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise bad_request(f"{where}: {first.get('msg')}" if where else str(first.get("msg"))) from None


def plan_chat(body: ChatCompletionRequest, ctx: ServingContext) -> ChatRequestPlan:
    """Check ``body`` and plan it (APIError 400 naming the field when bad). The constraint is checked by
    ``check_plan`` (on a thread: a large schema takes milliseconds)."""
    ctx.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = ctx.sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    tools, params = _plan_tools(body, ctx, params)
    if tools is not None:
        tools = dataclasses.replace(tools, answered=answered_calls(body.messages))
    ctx.check_size(params, 1)
    messages = messages_for_tools(messages_as_dicts(body.messages), tools, body.messages)
    add_generation_prompt = generation_prompt(body)
    role = "assistant" if add_generation_prompt else messages[-1]["role"]  # vLLM's get_chat_request_role
    # vLLM's echo: the final message's text when its role is the reply's; a reply to a user message echoes nothing
    echo = messages[-1]["content"] if body.echo and messages[-1]["role"] == role else ""
    # The template adds its own markup around the messages and keeps their text, so the text alone bounds the
    # prompt from below.
    ctx.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages", "the messages' text")
    return ChatRequestPlan(body, params, tools, messages, add_generation_prompt, role, echo, max_tokens,
                           _template_kwargs(body.chat_template_kwargs))


async def check_plan(plan: ChatRequestPlan, ctx: ServingContext) -> ChatRequestPlan:
    await ctx.check_constraint(plan.params, plan.body.constraint_field or "tool_choice")
    return plan


def _template_kwargs(kwargs: dict | None) -> dict:
    for name in kwargs or {}:
        if not name.isidentifier() or name in RESERVED_TEMPLATE_VARIABLES:
            raise bad_request(f"chat_template_kwargs: {name!r} cannot be given to the template (names must be "
                              f"identifiers other than {', '.join(sorted(RESERVED_TEMPLATE_VARIABLES))})",
                              "chat_template_kwargs")
    return dict(kwargs or {})


def _plan_tools(body: ChatCompletionRequest, ctx: ServingContext, params: SamplingParams):
    """The request's tool plan and its params, constrained when the plan says so (400 when malformed)."""
    try:
        choice = body.tool_choice if body.tool_choice is None or isinstance(body.tool_choice, str) else \
            body.tool_choice.model_dump()
        plan = plan_tools(body.tools, choice, body.parallel_tool_calls, ctx.tool_call_parser, ctx.chat_template)
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
