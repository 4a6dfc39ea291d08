"""A submitted chat request (``ChatRun``): its engine streams, read as one stream of ``ChoiceEvent`` per choice
(reasoning, answer text, tool calls, the finish), streamed or collected whole through the same parsers.

A reply in the generic tool format whose first call repeats a call the conversation already holds the result
of is not returned: the model had what it needed and should have answered. The request is then generated once
more, constrained to an answer (the generic format's ``{"response": ...}``): a small model otherwise calls the
same tool after each result until an agent gives up, and never answers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from conveyor.core.outputs import TokenLogprobs
from conveyor.core.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from conveyor.engine.engine_client import RequestStream
from conveyor.engine.outputs import RequestOutput
from conveyor.server.reasoning import ReasoningSplitter, reasoning_block
from conveyor.server.reply import ReplyDelta, ReplyParser, ReplyResult, finish_reason
from conveyor.server.serving_common import ServingContext, merged, token_usage

if TYPE_CHECKING:
    from conveyor.server.chat_plan import ChatRequestPlan


@dataclass
class ChoiceEvent:
    """What one choice produced since its previous event. ``finish_reason`` is set on its last event;
    ``logprobs`` covers the tokens of this event (with ``logprobs`` asked for), ``num_tokens`` those so far."""

    index: int
    delta: ReplyDelta
    num_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatRun:
    """A submitted chat request: its streams, read as ``ChoiceEvent`` (``events``) or collected whole
    (``results``). Both read the text with the same parsers, so a streamed reply and a whole one agree.
    ``streams`` is one list for the run's life (a new attempt replaces its items), so whoever aborts it on a
    disconnect aborts what runs now."""

    def __init__(self, ctx: ServingContext, plan: ChatRequestPlan, request_id: str, prompt_ids: list[int],
                 start: str | None, raw: Request) -> None:
        self.ctx, self.plan, self.request_id, self.raw = ctx, plan, request_id, raw
        self.streams: list[RequestStream] = []
        self.prompt_ids = prompt_ids
        self.prompt_tokens = len(prompt_ids)
        self.created = int(time.time())
        self.final: RequestOutput | None = None
        self.token_ids: list[list[int]] = []  # each choice's generated tokens (of the attempt returned)
        self.retried_tokens = 0  # tokens of an attempt that was not returned (counted in the usage)
        self._start = start
        self._params: SamplingParams | None = None

    async def submit(self, params: SamplingParams, attempt: str = "") -> None:
        """Queue the request with ``params``, adjusted for a reply that reasons: a constraint applies after the
        reasoning block, and markers that are special tokens are decoded."""
        start = self._start
        if start is not None and params.structured_outputs is not None:
            block = reasoning_block(self.ctx.reasoning, start)
            params = dataclasses.replace(
                params, structured_outputs=dataclasses.replace(params.structured_outputs, reasoning=block))
        if start is not None and self.ctx.reasoning.decodes_markers:
            params = dataclasses.replace(params, skip_special_tokens=False)  # the markers must reach the text
        # Every reply is read as deltas (``_read``), streamed or not.
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        self._params = params
        ids = self.prompt_ids
        streams = await self.ctx.submit(self.request_id + attempt, [lambda _: {"prompt_token_ids": ids}], params,
                                        self.raw, self.plan.body.service_tier)
        self.streams[:] = streams

    def _parser(self) -> ReplyParser:
        splitter = None
        if self._start is not None:
            r = self.ctx.reasoning
            splitter = ReasoningSplitter(r.syntax, self._start, r.drop)
        return ReplyParser(splitter, self.plan.tools.reply_parser() if self.plan.tools is not None else None)

    @property
    def reasons(self) -> bool:
        """Whether replies may hold reasoning (the model reasons and the prompt left room for it)."""
        return self._start is not None and self._start != "closed"

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's events as the engine produces them; each choice's last one carries its finish reason.
        A choice whose reply is complete early (``ReplyParser.done``) finishes at once, and the request is
        aborted when all its choices have. A reply that should have been an answer (above) is generated again."""
        answer = self._answer_constraint()
        async for event in self._read(can_retry=answer is not None):
            if event is not None:
                yield event
                continue
            self.retried_tokens += sum(s.num_generated_tokens for s in self.streams)
            self.ctx.abort(self.streams)
            await self.submit(dataclasses.replace(self._params, structured_outputs=answer), "-answer")
            async for again in self._read(can_retry=False):
                yield again
            return

    def _answer_constraint(self) -> StructuredOutputsParams | None:
        tools = self.plan.tools
        if tools is None or tools.answer_constraint is None or self.plan.params.n != 1:
            return None
        return tools.answer_constraint

    async def _read(self, can_retry: bool) -> AsyncIterator[ChoiceEvent | None]:
        """One attempt's events; None (and nothing more) when its one reply is to be generated again (only before
        anything of it was sent, and ``can_retry``)."""
        params = self._params
        parsers = [self._parser() for _ in range(params.n)]
        self.token_ids = [[] for _ in range(params.n)]
        calls = [0] * params.n
        closed: set[int] = set()
        sent = False
        async for _, out in merged(self.streams):  # deltas: each choice's new text, tokens and logprobs
            self.final = out
            for c in out.outputs:
                if c.index in closed:
                    continue
                finished = c.finished
                self.token_ids[c.index] += c.token_ids
                parser = parsers[c.index]
                delta = parser.feed(c.text)
                if parser.wants_answer and can_retry and not sent and not delta:
                    yield None
                    return
                if finished or parser.done:
                    delta += parser.finish()
                calls[c.index] += sum(d.id is not None for d in delta.tool_calls)
                event = ChoiceEvent(c.index, delta, c.num_tokens + self.retried_tokens, c.logprobs)
                sent = sent or bool(delta)
                if finished or parser.done:
                    closed.add(c.index)
                    event.finish_reason = finish_reason(c.finish_reason, parser, calls[c.index] > 0)
                    event.stop_reason = c.stop_reason if finished and not parser.done else None
                yield event
            if len(closed) == params.n and not out.finished:
                self.ctx.abort(self.streams)  # every reply is complete: the rest of the generation is not wanted

    async def results(self, raw: Request) -> list[ReplyResult]:
        """Every choice, whole (a client that disconnects first aborts the request)."""

        async def collect() -> list[ReplyResult]:
            results = [ReplyResult(i) for i in range(self.plan.params.n)]
            async for event in self.events():
                result = results[event.index]
                result.add(event.delta)
                result.num_tokens = event.num_tokens
                if event.logprobs is not None:
                    result.logprobs = (result.logprobs or []) + event.logprobs
                if event.finish_reason is not None:
                    result.finish_reason, result.stop_reason = event.finish_reason, event.stop_reason
            return results

        return await self.ctx.unless_disconnected(collect(), self.streams, raw)

    def usage(self) -> dict:
        """Token counts (an attempt that was not returned included: it was computed)."""
        return token_usage(self.prompt_tokens, sum(s.num_generated_tokens for s in self.streams)
                           + self.retried_tokens)
