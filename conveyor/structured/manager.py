"""Grammars compiled off the step loop and cached, and the per-step work on the constrained rows of a batch.

The engine asks ``compile(spec)`` when a constrained request arrives and keeps the request out of the scheduler
until the returned future is done (``LLMEngine``'s grammar gate), so a new grammar never delays the tokens of
requests already running. The runner then asks ``matcher(spec, replay)`` when the request is admitted (again
after a preemption: the matcher is rebuilt by replaying the tokens generated so far), ``fill_bitmask`` before
sampling and ``consume`` after.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from conveyor.core.sampling_params import StructuredOutputsParams
from conveyor.structured.grammars import error_text, grammar_text, parser_limits, spec_key

logger = logging.getLogger("conveyor.structured")

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (a schema an application sends again compiles once)


class StructuredOutputs:
    """Owns the llguidance tokenizer (built on first use, in the compile thread: a few hundred ms), the grammar
    cache and the thread that compiles. Thread-safe for ``compile``; the rest runs on the step loop's thread."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._ll_tokenizer = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-grammar")
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Future] = OrderedDict()

    def prepare(self) -> None:
        """Build the llguidance tokenizer now, on the compile thread, instead of at the first constrained request:
        it holds the GIL for 0.4 s (seconds on a loaded machine), which would stall the steps of requests already
        running. Servers call it at start-up; offline engines build it when first needed."""
        self._pool.submit(self._ensure_tokenizer)

    def _ensure_tokenizer(self) -> None:
        if self._ll_tokenizer is not None:  # (only the one compile thread runs this: no lock)
            return
        from conveyor.structured.vocabulary import ll_tokenizer

        self._ll_tokenizer = ll_tokenizer(self._tokenizer, self.vocab_size)

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled matcher for ``spec`` (done at once when cached); its exception is a
        ValueError for a constraint that cannot be enforced. Nothing of the compilation runs in the caller's
        thread (the API side checks requests beforehand with ``grammars.grammar_text``, for a 400)."""
        key = spec_key(spec)
        with self._lock:
            future = self._compiled.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._compiled.move_to_end(key)
                return future
            future = self._pool.submit(self._build, spec)
            self._compiled[key] = future
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return future

    def _build(self, spec: StructuredOutputsParams):
        import llguidance

        text = grammar_text(spec)
        self._ensure_tokenizer()
        matcher = llguidance.LLMatcher(self._ll_tokenizer, text, log_level=0, limits=parser_limits())
        if matcher.is_error():
            logger.warning("a grammar did not compile: %s", matcher.get_error().splitlines()[0][:300])
            raise ValueError(f"structured_outputs: {error_text(matcher.get_error())}")
        return matcher

    def matcher(self, spec: StructuredOutputsParams, replay: list[int]):
        """A fresh matcher for one request, advanced over ``replay`` (its tokens so far after a preemption)."""
        future = self.compile(spec)
        template = future.result()  # done: the engine admits a request only once its grammar is compiled
        matcher = template.deep_copy()
        if replay and not matcher.consume_tokens(replay):
            raise ValueError(f"structured_outputs: the tokens generated so far do not match the grammar: "
                             f"{error_text(matcher.get_error())}")
        return matcher

    def fill_bitmask(self, matchers: list) -> torch.Tensor:
        """[len(matchers), ceil(vocab / 32)] int32: bit t of a row set when that matcher allows token t next.

        One matcher after another (tens of microseconds each), on the thread that overlaps the forward pass,
        straight into the tensor's rows. (Not through ``llguidance.torch``: importing it runs ``torch.compile``,
        which loaded torch's compiler stack for 4-8 s in the first step that needed a mask.)"""
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
        base, row_bytes = bitmask.data_ptr(), words * 4
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        return bitmask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


BIT_POSITIONS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: -inf on ``logits[rows]`` wherever the row's bitmask forbids the token (every column past the
    bitmask's width too)."""
    vocab = logits.shape[1]
    allowed = ((bitmask.unsqueeze(-1) >> BIT_POSITIONS) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    sub = logits.index_select(0, index)
    if allowed.shape[1] < vocab:
        sub[:, allowed.shape[1]:] = float("-inf")
        sub[:, :allowed.shape[1]].masked_fill_(~allowed.to(logits.device), float("-inf"))
    else:
        sub.masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, index, sub)
