"""A streamed reply as a sequence of blocks, for the protocols whose streams open and close one block at a time
(Anthropic's content blocks, the Responses API's output items): reasoning, then answer text, then each tool call.

``BlockSequencer.feed`` turns each ``ReplyDelta`` into the blocks it opens, extends and closes, in order; a block
opens on its first text and closes when another begins or the reply ends (``close``).
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.server.reply import ReplyDelta

KINDS = ("reasoning", "text", "tool_call")


@dataclass
class Block:
    """One block of a reply: its position, its kind, its text so far (a tool call's: its arguments), and for
    a tool call its id and name."""

    index: int
    kind: str
    text: str = ""
    call_id: str | None = None
    name: str | None = None


@dataclass
class BlockEvent:
    """``what``: "start" (``text`` is empty), "delta" (``text``: what it adds) or "stop" (the block is whole)."""

    what: str
    block: Block
    text: str = ""


class BlockSequencer:
    """The blocks of one reply, as its deltas arrive. ``keep_reasoning`` False drops the reasoning (the client
    did not ask for it: it is never sent as anything else either)."""

    def __init__(self, keep_reasoning: bool = True) -> None:
        self.keep_reasoning = keep_reasoning
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}  # a reply's call index -> its block

    def feed(self, delta: ReplyDelta) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if delta.reasoning and self.keep_reasoning:
            events += self._extend("reasoning", delta.reasoning)
        if delta.content:
            events += self._extend("text", delta.content)
        for call in delta.tool_calls:
            if call.id is not None:
                events += self._begin(Block(len(self.blocks), "tool_call", call_id=call.id, name=call.name))
                self._calls[call.index] = self._open
            if call.arguments:
                block = self._calls[call.index]
                block.text += call.arguments
                events.append(BlockEvent("delta", block, call.arguments))
        return events

    def close(self) -> list[BlockEvent]:
        """The reply ended: the open block closes."""
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("stop", block)]

    def _extend(self, kind: str, text: str) -> list[BlockEvent]:
        events = []
        if self._open is None or self._open.kind != kind:
            events += self._begin(Block(len(self.blocks), kind))
        self._open.text += text
        events.append(BlockEvent("delta", self._open, text))
        return events

    def _begin(self, block: Block) -> list[BlockEvent]:
        events = self.close()
        self.blocks.append(block)
        self._open = block
        return [*events, BlockEvent("start", block)]
