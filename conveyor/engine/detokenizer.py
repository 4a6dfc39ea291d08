"""Incremental detokenization and stop strings.

Decoding token by token breaks multi-byte characters and the leading-space rules of SentencePiece tokenizers,
so each step decodes a short window twice (as Hugging Face TGI does): the text of ``[prefix_offset,
read_offset)`` and of ``[prefix_offset, end)``; the difference is the new text, held back while it ends in an
incomplete UTF-8 sequence (U+FFFD).

A stream (``SamplingParams.output_kind`` DELTA) takes the text as it grows (``release``), held back while the
completion runs by ``stop_buffer_length`` characters: a stop string that a later token completes cuts the text at
the stop string's start, which may lie that far before the end. So nothing a stream has been given is ever cut.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens to seed the window with, so the first output token decodes in context


class IncrementalDetokenizer:
    """Turns a growing list of token ids into growing text; checks stop strings on the way."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], include_stop: bool,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.text = ""
        self._max_stop_len = max((len(s) for s in stop), default=0)
        # With the stop string kept in the text, the cut falls after text already seen: nothing to hold back.
        self.stop_buffer_length = 0 if include_stop else max(self._max_stop_len - 1, 0)
        self._released = 0  # characters of text handed out by release()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed (text is then truncated), else None."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # nothing printable yet
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._check_stop(old_len)

    def release(self, finished: bool) -> tuple[int, str]:
        """The text not handed out yet, and where it starts: all of it once the completion has finished, else
        all but the last ``stop_buffer_length`` characters."""
        end = len(self.text) if finished else max(self._released, len(self.text) - self.stop_buffer_length)
        start, self._released = self._released, end
        return start, self.text[start:end]

    def _check_stop(self, old_len: int) -> str | None:
        if not self.stop:
            return None
        # A stop string may straddle the old and new text: search from just before the new part.
        start = max(0, old_len - self._max_stop_len + 1)
        found = [(pos, s) for s in self.stop if (pos := self.text.find(s, start)) != -1]
        if not found:
            return None
        pos, s = min(found)  # the earliest stop string wins
        self.text = self.text[: pos + len(s)] if self.include_stop else self.text[:pos]
        return s
