"""Bounds at the edge of the server, their values and checks: the request body's size (enforced by
``body_limit.BodyLimitMiddleware``), sequences per request, stop conditions, and how many characters a text prompt
may have before it certainly cannot fit in the context.

Each bound refuses, with a 4xx in OpenAI's error shape, a request that would otherwise cost the server memory or
time out of proportion to anything it could serve: a body of gigabytes, a thousand stop strings of a megabyte each
(they travel to the engine and are checked at every token), a prompt that takes the tokenizer seconds only to be
found too long for the context. Plain Python: ``conveyor serve --help`` reads the defaults from here.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("conveyor.server")

# The largest request body the server reads (--max-request-body-bytes). The largest legitimate bodies are
# long-context prompts: 8K tokens of text are ~40 KB, 128K tokens ~600 KB as text or ~900 KB as token ids
# ("12345, " per token). 4 MiB holds several of those and stops a body of gigabytes after 4 MiB.
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# How long an idle keep-alive connection stays open after a response (--timeout-keep-alive). Above the 5 s after which common clients
# (httpx and so the openai and anthropic SDKs, aiohttp's 15 s aside) stop reusing an idle connection: with equal
# expiries a client can send a request on a connection the server is closing that instant, and that request gets
# no answer (a ReadError; the SDKs retry it, a plain client does not).
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 65.0
# A file upload's multipart framing (boundaries, part headers, the purpose field) beyond the file's own bytes.
UPLOAD_OVERHEAD_BYTES = 64 * 1024
# The most sequences (prompts x n) one request may ask for (--max-seqs-per-request): the default running batch
# (--max-num-seqs 256), so one request can fill a batch but cannot queue thousands of sequences that outlive a
# client who gives up. n alone stays bounded by --max-n (128, OpenAI's limit).
DEFAULT_MAX_SEQS_PER_REQUEST = 256
# Stop conditions travel to the engine with the request and are checked at every generated token; the streamed
# text is held back by the longest stop string. OpenAI allows 4 stop strings; harnesses send a handful of short
# ones ("\n\n", "Question:", "</answer>"). These bounds leave room for any such use.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


def check_stop(stop: list[str], stop_token_ids: list[int]) -> None:
    """ValueError (message starting with the field's name, which the server reports as ``param``) for stop
    conditions beyond the bounds above, or a stop string that is not valid Unicode (a lone surrogate, which JSON
    can carry: refused in ``prompt`` too)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for i, s in enumerate(stop):
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop string {i} has {len(s)} characters; at most {MAX_STOP_STRING_CHARS} are allowed")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"stop string {i} is not valid Unicode text: {exc.reason} at position {exc.start}") \
                from None
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids has {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")


# ---- prompt characters --------------------------------------------------------------------------------------
# Texts a tokenizer that keeps every character must spend tokens on: a tokenizer that encodes one of them into
# fewer than len(text) / max_token_chars tokens drops or folds characters (splits on whitespace, one unknown
# token for a whole word, a normalizer that deletes control characters or accents), and no character bound holds.
_PROBES = (" ", "\x00", "\u0301", "x", "\ue000", "e\u0301")


def max_token_chars(tokenizer) -> int | None:
    """The most characters of input text one token of ``tokenizer`` can stand for, or None when there is no such
    bound (then no prompt is refused by its length in characters).

    The bound is the longest text any single token decodes to, plus one: a decoder may drop the leading space a
    lone token carries (SentencePiece's "▁"), which the token does consume. It holds for tokenizers that keep every
    character of their input: byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2), SentencePiece with byte fallback
    (Llama 2, Mistral), the embedded byte tokenizer; up to Unicode normalization, which composes at most a few
    characters into one. Tokenizers that drop or fold characters are found by encoding a few probe texts (above).
    Costs one decode per vocabulary entry (0.04 s for SmolLM2's 49,152)."""
    longest = max((len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size)),
                  default=0)
    bound = longest + 1
    repeat = 8 * bound  # folding shows as a gap of 8x or more
    for unit in _PROBES:
        text = unit * repeat
        try:
            num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        except Exception:  # noqa: BLE001 - a tokenizer that cannot encode a probe cannot vouch for a bound
            num_tokens = -1
        if num_tokens * bound < len(text):
            logger.info("prompt length check off: this tokenizer encodes %d x %r into %d tokens, so no number of "
                        "characters is certain to exceed the context", repeat, unit, num_tokens)
            return None
    return bound
