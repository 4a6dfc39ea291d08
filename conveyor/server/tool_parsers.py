"""Tool calls read out of a reply while it is generated: one parser per tool syntax, fed the reply's text piece by
piece, each piece split into answer text and tool-call deltas.

The same parser serves a streamed reply and a whole one (a whole reply is one piece), so the two always agree.
What every parser does:

- a call is returned once its JSON is complete, also when the reply is cut afterwards (``max_tokens``): the
  complete calls are ``tool_calls``, an incomplete trailing one is dropped, and the raw call syntax is never
  returned as answer text;
- a call that repeats one already made in the same reply (same name, same arguments) ends the reply: ``done``
  turns true and the caller stops the generation (a small model otherwise repeats its call until ``max_tokens``);
- with ``one_call`` (the client set ``parallel_tool_calls: false``) the first call ends the reply;
- a call the conversation already holds the result of (``answered``) is not made again: it ends the reply, and
  when it is the reply's first call ``wants_answer`` turns true (the caller may then ask for an answer instead);
- answer text streams as it comes, holding back only what may be the start of a call's marker.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_DECODER = json.JSONDecoder()
_SEPARATORS = " \t\r\n,;"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """More of the ``index``-th call of a reply: its id and name on its first delta, then argument text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedPiece:
    """What one piece of a reply adds: answer text and tool-call deltas."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: ParsedPiece) -> ParsedPiece:
        self.content += other.content
        self.calls += other.calls
        return self


class ToolParser(Protocol):
    """Reads one reply. ``done``: the reply is complete (a repeated call, or the one call allowed); whatever is
    fed afterwards is ignored. ``wants_answer``: its first call repeats an answered one."""

    done: bool
    wants_answer: bool

    def feed(self, text: str) -> ParsedPiece: ...

    def finish(self) -> ParsedPiece:
        """The reply ended: what is still held back (text that turned out not to be a marker, a call whose JSON
        is complete only now)."""
        ...


def _value(arguments: Any) -> Any:
    """Arguments given as JSON text, as the value they hold (text that is not JSON stays text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            pass
    return arguments


def call_key(name: str, arguments: Any) -> tuple[str, str]:
    """What makes two calls the same: the name and the arguments' value (as canonical JSON)."""
    return name, json.dumps(_value(arguments), sort_keys=True, ensure_ascii=False)


class _Calls:
    """The calls of one reply so far: ids, the repeat checks and the one-call rule."""

    def __init__(self, one_call: bool, answered: frozenset = frozenset()) -> None:
        self.one_call = one_call
        self.answered = answered
        self.done = False
        self.wants_answer = False
        self._seen: list[tuple[str, str]] = []

    @property
    def made(self) -> int:
        return len(self._seen)

    def call(self, obj: Any) -> list[ToolCallDelta]:
        """The delta of a complete call object ``{"name", "arguments" | "parameters"}`` (nothing when it repeats
        an earlier call or is not a call)."""
        if self.done or not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        args = _value(obj.get("arguments", obj.get("parameters", {})))
        key = call_key(obj["name"], args)
        if key in self.answered:
            self.done, self.wants_answer = True, not self._seen
            return []
        if key in self._seen:
            self.done = True
            return []
        self._seen.append(key)
        self.done = self.one_call
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return [ToolCallDelta(len(self._seen) - 1, text, new_call_id(), obj["name"])]


def _complete_objects(text: str, pos: int) -> tuple[list[Any], int, bool]:
    """The complete JSON values in ``text`` from ``pos`` on, separated by whitespace, commas or semicolons:
    (values, position after the last one, whether a closing ``]`` was reached)."""
    found = []
    while True:
        while pos < len(text) and text[pos] in _SEPARATORS:
            pos += 1
        if pos >= len(text):
            return found, pos, False
        if text[pos] == "]":
            return found, pos + 1, True
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return found, pos, False  # incomplete (or, unconstrained, not JSON): wait for more
        found.append(value)
        pos = end


def json_string_prefix(text: str, pos: int) -> tuple[str, int, bool]:
    """Decode a JSON string's body from ``pos`` (just after its opening quote) as far as it is complete:
    (text, position after what was decoded, whether the closing quote was reached). An escape cut in the middle
    waits for the rest."""
    out = []
    while pos < len(text):
        c = text[pos]
        if c == '"':
            return "".join(out), pos + 1, True
        if c != "\\":
            out.append(c)
            pos += 1
            continue
        if pos + 1 >= len(text):
            break
        kind = text[pos + 1]
        if kind != "u":
            out.append(_ESCAPES.get(kind, kind))
            pos += 2
            continue
        if pos + 6 > len(text):
            break
        code = int(text[pos + 2:pos + 6], 16)
        if 0xD800 <= code < 0xDC00:  # a surrogate pair: both halves or nothing
            if pos + 12 > len(text):
                break
            code = 0x10000 + ((code - 0xD800) << 10) + (int(text[pos + 8:pos + 12], 16) - 0xDC00)
            pos += 6
        out.append(chr(code))
        pos += 6
    return "".join(out), pos, False


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class NamedParser:
    """A named ``tool_choice``: the whole reply is that function's arguments, streamed as they are written."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.done = self.wants_answer = False  # the client named the call: it is made whatever came before
        self._started = False

    def feed(self, text: str) -> ParsedPiece:
        if self._started:
            return ParsedPiece(calls=[ToolCallDelta(0, text)] if text else [])
        self._started = True
        return ParsedPiece(calls=[ToolCallDelta(0, text, new_call_id(), self.name)])

    def finish(self) -> ParsedPiece:
        return ParsedPiece() if self._started else self.feed("")


class _CallReader:
    """What the parsers that read calls share: the reply's calls (``_Calls``) and what they tell the caller."""

    _calls: _Calls

    @property
    def done(self) -> bool:
        return self._calls.done

    @property
    def wants_answer(self) -> bool:
        return self._calls.wants_answer


class JsonEnvelopeParser(_CallReader):
    """Replies constrained to JSON: ``tool_choice: "required"`` (an array of ``{"name", "arguments"}``) and the
    generic format of ``"auto"`` (``{"tool_calls": [...]}`` or ``{"response": "..."}``, llama.cpp's)."""

    OPENINGS = {"calls": re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\['),
                "response": re.compile(r'\s*\{\s*"response"\s*:\s*"')}
    ARRAY = {"calls": re.compile(r"\s*\[")}

    def __init__(self, envelope: bool, one_call: bool, answered: frozenset = frozenset()) -> None:
        self._openings = self.OPENINGS if envelope else self.ARRAY
        self._calls = _Calls(one_call, answered)
        self._text = ""
        self._mode: str | None = None
        self._pos = 0

    def feed(self, text: str) -> ParsedPiece:
        if self.done or self._mode == "closed":
            return ParsedPiece()
        self._text += text
        if self._mode is None:
            for mode, opening in self._openings.items():
                match = opening.match(self._text)
                if match:
                    self._mode, self._pos = mode, match.end()
                    break
            else:
                return ParsedPiece()
        if self._mode == "response":
            content, self._pos, closed = json_string_prefix(self._text, self._pos)
            self._mode = "closed" if closed else self._mode
            return ParsedPiece(content)
        objects, self._pos, closed = _complete_objects(self._text, self._pos)
        self._mode = "closed" if closed else self._mode
        return ParsedPiece(calls=[d for obj in objects for d in self._calls.call(obj)])

    def finish(self) -> ParsedPiece:
        return ParsedPiece()  # an envelope cut short: its complete calls were returned, the rest is dropped


class MarkedCallsParser(_CallReader):
    """Model-native syntaxes, unconstrained: answer text, then calls behind a marker.

    - ``hermes``: ``<tool_call>{"name", "arguments"}</tool_call>`` (Qwen2.5/3, Hermes and many fine-tunes);
    - ``mistral``: ``[TOOL_CALLS][{...}, ...]``, or ``[TOOL_CALLS]name[ARGS]{...}`` (newer Mistral templates);
    - ``llama3_json``: a reply that starts with ``{`` (or ``<|python_tag|>``) is calls separated by ``;``."""

    MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}

    def __init__(self, syntax: str, one_call: bool, answered: frozenset = frozenset()) -> None:
        self.syntax = syntax
        self.marker = self.MARKERS[syntax]
        self._calls = _Calls(one_call, answered)
        self._text = ""  # everything fed
        self._pos = 0  # how much of it is settled (sent as content, or read as calls)
        self._in_calls = False

    def feed(self, text: str) -> ParsedPiece:
        if self.done:
            return ParsedPiece()
        self._text += text
        piece = ParsedPiece()
        while not self.done:
            before = self._pos
            piece += self._read_calls() if self._in_calls else self._read_content()
            if self._pos == before:
                return piece
        return piece

    def finish(self) -> ParsedPiece:
        if self.done:
            return ParsedPiece()
        piece = self.feed("")
        if not self._in_calls:
            rest = self._text[self._pos:]  # no marker after all
            piece.content += rest if rest.strip() or not self._calls.made else ""
        elif self.syntax == "hermes":  # a last call without its closing tag
            body = self._text[self._pos:].strip()
            try:
                piece.calls += self._calls.call(json.loads(body))
            except ValueError:
                pass
        self._pos = len(self._text)
        return piece

    def _read_content(self) -> ParsedPiece:
        rest = self._text[self._pos:]
        if self.syntax == "llama3_json" and self._pos == 0:
            stripped = rest.lstrip()
            if stripped[:1] == "{":
                self._in_calls, self._pos = True, len(self._text) - len(stripped)
                return ParsedPiece()
            if not stripped or (self.marker.startswith(stripped) and len(stripped) < len(self.marker)):
                return ParsedPiece()  # not known yet
        if self._calls.made:  # whitespace between calls is dropped; after the last one it waits for the end
            stripped = rest.lstrip()
            if not stripped or (self.marker.startswith(stripped) and len(stripped) < len(self.marker)):
                return ParsedPiece()
            if stripped.startswith(self.marker):
                self._pos += len(rest) - len(stripped)
                rest = stripped
        at = rest.find(self.marker)
        if at >= 0:
            self._in_calls, self._pos = True, self._pos + at + len(self.marker)
            return ParsedPiece(rest[:at])
        if self.syntax == "llama3_json":
            send = len(rest)  # a llama3 call starts the reply or never
        else:
            send = len(rest) - _held_back(rest, self.marker)
        self._pos += send
        return ParsedPiece(rest[:send])

    def _read_calls(self) -> ParsedPiece:
        if self.syntax == "hermes":
            end = self._text.find("</tool_call>", self._pos)
            if end < 0:
                return ParsedPiece()
            body = self._text[self._pos:end].strip()
            self._pos, self._in_calls = end + len("</tool_call>"), False
            try:
                return ParsedPiece(calls=self._calls.call(json.loads(body)))
            except ValueError:
                return ParsedPiece()
        if self.syntax == "mistral":
            named = re.match(r"\s*([^\s\[{]+)\[ARGS\]", self._text[self._pos:])
            if named:
                try:
                    args, end = _DECODER.raw_decode(self._text, self._pos + named.end())
                except ValueError:
                    return ParsedPiece()
                self._pos, self._in_calls = end, False
                return ParsedPiece(calls=self._calls.call({"name": named.group(1), "arguments": args}))
            rest = self._text[self._pos:].lstrip()
            if rest.startswith("["):
                self._pos = len(self._text) - len(rest) + 1
        objects, self._pos, _ = _complete_objects(self._text, self._pos)
        return ParsedPiece(calls=[d for obj in (_flatten(objects)) for d in self._calls.call(obj)])


def _flatten(values: list[Any]) -> list[Any]:
    return [v for value in values for v in (value if isinstance(value, list) else [value])]


def make_parser(syntax: str, one_call: bool, named: str | None = None,
                answered: frozenset = frozenset()) -> ToolParser:
    """The parser of one reply in ``syntax`` ("named", "required", "generic", "hermes", "mistral",
    "llama3_json"); ``answered``: the ``call_key`` of every call the conversation holds the result of."""
    if syntax == "named":
        return NamedParser(named)
    if syntax == "required":  # the client asked for a call: an answered one may be asked for again
        return JsonEnvelopeParser(envelope=False, one_call=one_call)
    if syntax == "generic":
        return JsonEnvelopeParser(envelope=True, one_call=one_call, answered=answered)
    return MarkedCallsParser(syntax, one_call, answered)
