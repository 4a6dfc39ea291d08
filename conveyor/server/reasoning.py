"""Reasoning kept apart from the answer: the reasoning block a model writes before its answer (``<think>...</think>``
as Qwen3 and the DeepSeek-R1 distills write it, Mistral's ``[THINK]...[/THINK]``) split off while the reply is
generated, so that no protocol ever returns it as the answer's text.

The syntax is chosen by ``--reasoning-parser`` or read from the chat template (a template that writes the markers
makes a model that reasons). Where the reply starts is read from the rendered prompt: a prompt that ends with the
start marker (DeepSeek-R1's templates open the block themselves) puts the reply inside the block, one that ends
with the end marker (Qwen3's ``enable_thinking: false`` writes an empty block) leaves only an answer, and
otherwise the reply may open a block itself. A constraint (structured outputs, tool calls) applies to the answer
after the block: ``reasoning_block`` describes the block to the grammar (``structured.grammars``).
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.core.sampling_params import ReasoningBlock


@dataclass(frozen=True)
class ReasoningSyntax:
    start: str
    end: str


SYNTAXES = {"deepseek_r1": ReasoningSyntax("<think>", "</think>"), "qwen3": ReasoningSyntax("<think>", "</think>"),
            "mistral": ReasoningSyntax("[THINK]", "[/THINK]")}
REASONING_PARSERS = (*SYNTAXES, "none")


def syntax_for(parser: str | None, template: str | None) -> ReasoningSyntax | None:
    """The reasoning syntax of the served model: ``--reasoning-parser`` (``"none"``: never split), else the
    markers its chat template writes (None: the model does not reason, replies are answers as they are)."""
    if parser is not None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
        return SYNTAXES.get(parser)
    template = template or ""
    for syntax in (SYNTAXES["deepseek_r1"], SYNTAXES["mistral"]):
        if syntax.start in template and syntax.end in template:
            return syntax
    return None


@dataclass(frozen=True)
class ModelReasoning:
    """How the served model reasons: its syntax; ``marker_ids``, the markers that are one token of its vocabulary
    (a grammar names them by id: llguidance reads added tokens as special); ``decodes_markers``, whether replies
    must be decoded with special tokens for the markers to reach the text (they are special tokens, as
    Mistral's), and ``drop``, the text of its other special tokens, removed from such replies."""

    syntax: ReasoningSyntax
    marker_ids: dict[str, int]
    decodes_markers: bool
    drop: tuple[str, ...]


def model_reasoning(parser: str | None, tokenizer) -> ModelReasoning | None:
    """The served model's ``ModelReasoning`` (None: it does not reason); ValueError for an unknown parser."""
    syntax = syntax_for(parser, tokenizer.chat_template)
    if syntax is None:
        return None
    special = set(tokenizer.all_special_ids)
    marker_ids = {}
    for marker in (syntax.start, syntax.end):
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1:
            marker_ids[marker] = ids[0]
    decodes = any(i in special for i in marker_ids.values())
    drop = ()
    if decodes:
        texts = (tokenizer.decode([i], skip_special_tokens=False) for i in sorted(special))
        drop = tuple(t for t in texts if t and t not in (syntax.start, syntax.end))
    return ModelReasoning(syntax, marker_ids, decodes, drop)


def reply_start(syntax: ReasoningSyntax, prompt_text: str) -> str:
    """Where a reply to ``prompt_text`` starts: "open" (inside a block the prompt opened), "closed" (the prompt
    ended the block: an answer only) or "maybe" (the reply may open a block)."""
    tail = prompt_text.rstrip()
    if tail.endswith(syntax.start):
        return "open"
    if tail.endswith(syntax.end):
        return "closed"
    return "maybe"


def reasoning_block(model: ModelReasoning, start: str) -> ReasoningBlock | None:
    """The block a constraint must let the reply write first (None when the reply is an answer only)."""
    if start == "closed":
        return None
    syntax, ids = model.syntax, model.marker_ids
    opens = None if start == "open" else syntax.start
    return ReasoningBlock(end=syntax.end, start=opens, end_token_id=ids.get(syntax.end),
                          start_token_id=ids.get(syntax.start) if opens else None)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that may begin one of ``markers``."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


class ReasoningSplitter:
    """One reply, split into reasoning and answer as it is fed. Whitespace around the block (the newlines after
    ``<think>`` and after ``</think>``) belongs to neither. ``drop``: texts removed wherever they appear (the
    other special tokens, when the markers are special tokens and the reply is decoded with them)."""

    def __init__(self, syntax: ReasoningSyntax, start: str, drop: tuple[str, ...] = ()) -> None:
        self.syntax = syntax
        self.state = start  # "maybe" | "open" | "closed"
        self.drop = drop
        self._pending = ""  # fed, not yet settled
        self._fresh = True  # nothing of the current part (reasoning or answer) sent yet: strip its leading space

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) added by ``text``."""
        return self._split(self._pending + text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._split(self._pending, final=True)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        for d in self.drop:
            text = text.replace(d, "")
        self._pending = ""
        reasoning = answer = ""
        if self.state == "maybe":
            head = text.lstrip()
            if head.startswith(self.syntax.start):
                self.state, text, self._fresh = "open", head[len(self.syntax.start):], True
            elif not final and self.syntax.start.startswith(head):
                self._pending = text  # may still become the start marker
                return "", ""
            else:
                self.state = "closed"
        if self.state == "open":
            at = text.find(self.syntax.end)
            if at < 0:
                keep = 0 if final else _held(text, (self.syntax.end, *self.drop))
                body = text[:len(text) - keep]
                settled = body if final else body.rstrip()  # trailing space waits: it may end the block
                self._pending = body[len(settled):] + text[len(text) - keep:]
                return self._part(settled), ""
            reasoning = self._part(text[:at].rstrip())
            self.state, text, self._fresh = "closed", text[at + len(self.syntax.end):], True
        keep = 0 if final else _held(text, self.drop)
        self._pending = text[len(text) - keep:]
        answer = self._part(text[:len(text) - keep])
        return reasoning, answer

    def _part(self, text: str) -> str:
        if self._fresh:
            text = text.lstrip()
            self._fresh = not text
        return text
