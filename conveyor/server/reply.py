"""One choice of a chat reply as every protocol sees it: reasoning, answer text and tool calls, read out of the
generated text piece by piece (``ReplyParser``), and the whole of it once it finished (``ReplyResult``).

Every protocol adapter (chat completions, Anthropic Messages, Responses, Ollama) maps these to its own wire
format; none of them reads generated text itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.core.outputs import TokenLogprobs
from conveyor.server.reasoning import ReasoningSplitter
from conveyor.server.tool_parsers import ParsedPiece, ToolCallDelta, ToolParser


@dataclass
class ReplyDelta:
    """What one piece of a choice's text adds."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __iadd__(self, other: ReplyDelta) -> ReplyDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class ReplyParser:
    """Reads one choice: the reasoning block split off first (``reasoning``), then the answer's tool calls
    (``tools``); either may be None. ``done``: the reply is complete before the model stopped (a repeated tool
    call, or the one call allowed), so the rest of its generation is not wanted."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def done(self) -> bool:
        return self.tools is not None and self.tools.done

    @property
    def wants_answer(self) -> bool:
        """The reply's first call repeats one the conversation already has the result of: it should have been
        an answer (``tool_parsers``)."""
        return self.tools is not None and self.tools.wants_answer

    def feed(self, text: str) -> ReplyDelta:
        if self.done:
            return ReplyDelta()
        thought, answer = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._answer(thought, self.tools.feed(answer) if self.tools else ParsedPiece(answer))

    def finish(self) -> ReplyDelta:
        """The choice ended: what was held back."""
        if self.done:
            return ReplyDelta()
        thought, answer = self.reasoning.finish() if self.reasoning else ("", "")
        if self.tools is None:
            return self._answer(thought, ParsedPiece(answer))
        piece = self.tools.feed(answer)
        piece += self.tools.finish()
        return self._answer(thought, piece)

    @staticmethod
    def _answer(thought: str, piece: ParsedPiece) -> ReplyDelta:
        return ReplyDelta(thought, piece.content, piece.calls)


@dataclass
class ToolCallResult:
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ReplyResult:
    """A finished choice. ``finish_reason``: "stop", "length", "tool_calls" (it ended with calls: the model
    stopped after them, or a repeated call ended it) or "abort"; ``stop_reason``: the stop string or token id
    that ended it, if any."""

    index: int
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallResult] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # of every token, when logprobs were asked for

    def add(self, delta: ReplyDelta) -> None:
        self.reasoning += delta.reasoning
        self.content += delta.content
        for d in delta.tool_calls:
            if d.id is not None:
                self.tool_calls.append(ToolCallResult(d.id, d.name, d.arguments))
            else:
                self.tool_calls[d.index].arguments += d.arguments


def finish_reason(engine_reason: str | None, parser: ReplyParser, made_calls: bool) -> str | None:
    """A choice's finish reason from the engine's and what its parser read. A reply that made calls and ended
    (the model stopped, or the parser ended it) says "tool_calls"; one cut by ``max_tokens`` says "length",
    whatever it holds."""
    if made_calls and (engine_reason == "stop" or parser.done):
        return "tool_calls"
    return "stop" if parser.done else engine_reason
