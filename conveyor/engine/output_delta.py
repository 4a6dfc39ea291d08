"""A request's outputs as increments, so that the engine core process sends each step's news, not the whole text
and every token id so far (which would make a long stream quadratic).

``DeltaEncoder`` (engine side) turns a cumulative ``RequestOutput`` into an ``OutputDelta``; ``DeltaDecoder`` (server
side) applies it to its own copy and returns a fresh cumulative ``RequestOutput``, the very object an in-process
engine would have delivered. Text only grows, except that a stop string may cut its tail: a delta says how many
characters of the previous text to keep, then what to append. Fields this module does not know are sent whole
(scalars every time, other top-level fields with the first delta), so new fields travel without changes here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from conveyor.engine.outputs import CompletionOutput, RequestOutput

_GROWING = ("token_ids", "token_times", "logprobs")  # lists a completion only appends to


@dataclass
class CompletionDelta:
    index: int
    keep_chars: int  # characters of the text already sent that are still the text's start
    text: str  # appended after them
    grown: dict[str, list]  # for each growing list: its new items
    other: dict  # every other field, by value


@dataclass
class OutputDelta:
    request_id: str
    completions: list[CompletionDelta]
    other: dict  # RequestOutput's fields but ``outputs``: all with the first delta, later the non-list ones and
    # the lists whose length changed (prompt_logprobs, filled as prefill chunks complete)
    first: bool


class DeltaEncoder:
    """Remembers, per unfinished request, how much of each completion has been sent."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, tuple[str, dict[str, int]]]] = {}
        self._list_lens: dict[str, dict[str, int]] = {}  # request id -> top-level list field -> length sent

    def encode(self, out: RequestOutput) -> OutputDelta:
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, {})
        completions = []
        for c in out.outputs:
            old_text, old_lens = sent.get(c.index, ("", {}))
            keep = _common_prefix_len(old_text, c.text)
            grown = {}
            for name in _GROWING:
                items = getattr(c, name)
                if items is not None:
                    grown[name] = items[old_lens.get(name, 0):]
            other = {f.name: getattr(c, f.name) for f in fields(c) if f.name not in _GROWING + ("text", "index")}
            completions.append(CompletionDelta(c.index, keep, c.text[keep:], grown, other))
            sent[c.index] = (c.text, {name: len(items) for name, items in
                                      ((n, getattr(c, n)) for n in _GROWING) if items is not None})
        list_lens = self._list_lens.setdefault(out.request_id, {})
        other = {}
        for f in fields(out):
            value = getattr(out, f.name)
            if f.name == "outputs":
                continue
            if isinstance(value, list):
                if not first and list_lens.get(f.name) == len(value):
                    continue
                list_lens[f.name] = len(value)
            other[f.name] = value
        if out.finished:
            del self._sent[out.request_id], self._list_lens[out.request_id]
        return OutputDelta(out.request_id, completions, other, first)


class DeltaDecoder:
    """The server side: a cumulative ``RequestOutput`` per unfinished request, rebuilt from deltas."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}

    def decode(self, delta: OutputDelta) -> RequestOutput:
        out = self._outputs.get(delta.request_id)
        if out is None:
            out = RequestOutput(**{**delta.other, "outputs": []})
            self._outputs[delta.request_id] = out
        else:
            for name, value in delta.other.items():
                setattr(out, name, value)
        by_index = {c.index: c for c in out.outputs}
        for d in delta.completions:
            c = by_index.get(d.index)
            if c is None:
                c = CompletionOutput(d.index, logprobs=None)
                out.outputs.append(c)
            c.text = c.text[:d.keep_chars] + d.text
            for name, items in d.grown.items():
                current = getattr(c, name)
                if current is None:
                    setattr(c, name, list(items))
                else:
                    current.extend(items)
            for name, value in d.other.items():
                setattr(c, name, value)
        if out.finished:
            del self._outputs[delta.request_id]
        return snapshot(out)


def snapshot(out: RequestOutput) -> RequestOutput:
    """A copy whose lists the owner may go on appending to while a reader holds it."""
    outputs = [
        replace(c, token_ids=list(c.token_ids), token_times=list(c.token_times),
                logprobs=None if c.logprobs is None else list(c.logprobs))
        for c in out.outputs
    ]
    return replace(out, outputs=outputs, metrics=replace(out.metrics))


def _common_prefix_len(old: str, new: str) -> int:
    """How much of ``old`` starts ``new`` (text grows, or a stop string cut its tail: almost always all of it)."""
    if new.startswith(old):
        return len(old)
    n = 0
    for a, b in zip(old, new):
        if a != b:
            break
        n += 1
    return n
