"""Constraints checked before they run, in processes of their own, under a time bound: ``GrammarChecker``.

A constraint the API process accepts must not fail once it runs. So before a constrained request reaches the
engine, its grammar is compiled here as the engine will compile it (``grammars.grammar_text``, llguidance's
``LLMatcher`` with ``PARSER_LIMITS``, over the served model's tokenizer) and walked ``WALK_TOKENS`` tokens, taking
the lowest allowed token at each step: llguidance reports most of its limits (items in an Earley row, items per
step, lexer states) only when a mask is computed, and the first masks are where a grammar of 10,000 alternatives or
of nested repetitions hits them. A grammar that allows nothing at the start, or that stops on the walk where it
cannot end, produces no string at all (a ``$ref`` cycle, ``x ::= x``): refused too, where the engine would answer
200 with "".

Compiling is native code that no thread can interrupt, and some grammars compile for minutes (a JSON schema with
12,000 optional properties: 27-65 s on a loaded machine, then a panic). The check therefore runs in worker
processes (``spawn``, each with its own llguidance tokenizer); one that has not answered within ``timeout_s`` is
killed and replaced, and the constraint is refused: nothing holds a thread for a minute, in this process or in the
engine, which compiles only what passed. Constraints that passed are remembered (``MAX_REMEMBERED``), so an
application's schema is checked once.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from conveyor.core.sampling_params import StructuredOutputsParams
from conveyor.structured.grammars import error_text, grammar_text, parser_limits, spec_key

logger = logging.getLogger("conveyor.structured")

CHECK_TIMEOUT_S = 10.0  # a compile this slow would stall constrained requests for as long: refused (--grammar-check-timeout)
CHECK_WORKERS = 2  # one slow check does not hold up the others
WALK_TOKENS = 16
MAX_REMEMBERED = 1024
START_TIMEOUT_S = 120.0  # a worker's start (an interpreter, llguidance, the tokenizer): a bound against hangs


class GrammarChecker:
    """``check(spec)`` raises ValueError ("structured_outputs.<kind>: why") for a constraint that cannot be
    enforced, that produces no output, that hits llguidance's limits on the first tokens, or whose check took
    longer than ``timeout_s``. Blocking (call it off the event loop); thread-safe. ``tokenizer``: the served
    model's tokenizer if it pickles (it travels to the workers), else its ``--model`` (each worker loads it);
    ``vocab_size``: the model's."""

    def __init__(self, tokenizer: Any, vocab_size: int, timeout_s: float = CHECK_TIMEOUT_S,
                 workers: int = CHECK_WORKERS) -> None:
        self._tokenizer, self._vocab_size, self.timeout_s = tokenizer, vocab_size, timeout_s
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        self._num_workers = workers
        self._started = False
        self._closed = False
        self._lock = threading.Lock()
        self._passed: OrderedDict[str, None] = OrderedDict()
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="conveyor-grammar-check")

    def start(self) -> None:
        """Start the workers, in the background (a second or two each; the first ``check`` does, so that a server
        whose clients send no constraint runs none); ``check`` waits for the first."""
        with self._lock:
            if self._started:
                return
            self._started = True
        for _ in range(self._num_workers):
            self._replace()

    async def check_async(self, spec: StructuredOutputsParams) -> None:
        """``check`` for the event loop: on the checker's own threads, one per worker, so that checks waiting for a
        worker never hold the loop's default executor (where prompts are tokenized)."""
        await asyncio.get_running_loop().run_in_executor(self._threads, self.check, spec)

    def _remembered(self, key: str) -> bool:
        with self._lock:
            if key in self._passed:
                self._passed.move_to_end(key)
                return True
        return False

    def check(self, spec: StructuredOutputsParams) -> None:
        key = spec_key(spec)
        if self._remembered(key):
            return
        self.start()
        worker = self._idle.get()
        if worker is None:
            self._idle.put(None)
            raise RuntimeError("the grammar checker is closed")
        try:
            error = worker.check(spec, self.timeout_s)
        except _TimedOut:
            worker.kill()
            logger.warning("a constraint's check ran past %.0f s: refused, and its worker replaced", self.timeout_s)
            self._replace()
            raise ValueError(f"structured_outputs.{spec.kind}: compiling it took longer than {self.timeout_s:g} s; "
                             "simplify it (fewer optional properties, alternatives or nested repetitions)") from None
        except (EOFError, OSError) as exc:  # the worker died under this constraint (a native crash)
            worker.kill()
            logger.warning("a grammar check worker died checking a constraint (%r): refused, worker replaced", exc)
            self._replace()
            raise ValueError(f"structured_outputs.{spec.kind}: the grammar compiler failed on this constraint") \
                from None
        except BaseException:
            worker.kill()
            self._replace()
            raise
        self._idle.put(worker)
        if error is not None:
            raise ValueError(error)
        with self._lock:
            self._passed[key] = None
            while len(self._passed) > MAX_REMEMBERED:
                self._passed.popitem(last=False)

    def close(self) -> None:
        """Stop the workers (those busy are killed when their check ends)."""
        self._closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                break
            if worker is not None:
                worker.kill()
        self._idle.put(None)

    def _replace(self) -> None:
        """Start a worker in a thread and hand it to the idle queue once it is ready."""
        def start() -> None:
            if self._closed:
                return
            try:
                self._idle.put(_Worker(self._tokenizer, self._vocab_size))
            except Exception as exc:  # noqa: BLE001 - a checker without workers refuses constraints, loudly
                if not self._closed:
                    logger.error("could not start a grammar check worker: %r", exc)
                    self._idle.put(_Broken(f"structured outputs are not available: {exc}"))

        threading.Thread(target=start, name="conveyor-grammar-check-start", daemon=True).start()


class _TimedOut(Exception):
    pass


class _Worker:
    """One worker process and its pipe."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._proc = context.Process(target=_serve, args=(child, tokenizer, vocab_size),
                                     name="conveyor-grammar-check", daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"the worker did not start within {START_TIMEOUT_S:.0f} s")
        ready, why = self._conn.recv()
        if not ready:
            self.kill()
            raise RuntimeError(why)

    def check(self, spec: StructuredOutputsParams, timeout_s: float) -> str | None:
        self._conn.send(spec)
        if not self._conn.poll(timeout_s):
            raise _TimedOut
        return self._conn.recv()

    def kill(self) -> None:
        self._proc.kill()
        self._proc.join(5)
        self._conn.close()


class _Broken:
    """Stands in for a worker that could not start: every check gets why."""

    def __init__(self, why: str) -> None:
        self.why = why

    def check(self, spec: StructuredOutputsParams, timeout_s: float) -> str | None:
        return f"structured_outputs.{spec.kind}: {self.why}"

    def kill(self) -> None:
        pass


# ---- the worker process -----------------------------------------------------------------------------------
def _serve(conn, tokenizer, vocab_size: int) -> None:
    """A worker's entry point: build the llguidance tokenizer, say ready, then answer checks until the pipe closes
    (the API process is gone) or the process is killed."""
    try:
        from conveyor.structured.vocabulary import ll_tokenizer

        if isinstance(tokenizer, str):
            from conveyor.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        ll = ll_tokenizer(tokenizer, vocab_size)
        eos = tokenizer.eos_token_id
    except Exception as exc:  # noqa: BLE001 - said to the API process, which refuses constraints with it
        conn.send((False, error_text(str(exc))))
        return
    conn.send((True, None))
    while True:
        try:
            spec = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(check_grammar(spec, ll, eos))
        except (EOFError, OSError):
            return


def check_grammar(spec: StructuredOutputsParams, ll_tokenizer: Any, eos_token_id: int | None,
                  walk_tokens: int = WALK_TOKENS) -> str | None:
    """Why ``spec`` cannot be served ("structured_outputs.<kind>: ..."), or None: it compiles with the engine's
    limits over ``ll_tokenizer`` and its first ``walk_tokens`` masks compute."""
    import llguidance

    kind = spec.kind
    try:
        text = grammar_text(spec)
    except ValueError as exc:
        return str(exc)
    matcher = llguidance.LLMatcher(ll_tokenizer, text, log_level=0, limits=parser_limits())
    for step in range(walk_tokens + 1):
        mask = b"" if matcher.is_error() else matcher.compute_bitmask()
        if matcher.is_error() or (matcher.is_stopped() and not matcher.is_accepting()):
            if not matcher.is_error() or error_text(matcher.get_error()) in NO_OUTPUT:
                where = "at its start" if step == 0 else f"after its first {step} tokens"
                return (f"structured_outputs.{kind}: the constraint matches no text (a rule or $ref that refers only "
                        f"to itself?): nothing can be generated {where}, and it cannot end there")
            return f"structured_outputs.{kind}: {error_text(matcher.get_error())}"
        token = _lowest_allowed(mask, eos_token_id)
        if token is None or step == walk_tokens:
            return None
        if not matcher.consume_token(token):
            return f"structured_outputs.{kind}: {error_text(matcher.get_error())}"
    return None


# The error of a matcher whose grammar has nothing more to match: no byte can extend the text, and it cannot end.
NO_OUTPUT = ("NoExtension", "NoExtensionBias")


def _lowest_allowed(mask: bytes, eos_token_id: int | None) -> int | None:
    """The lowest token id the bitmask allows, other than EOS (None: none)."""
    for i, byte in enumerate(mask):
        while byte:
            bit = (byte & -byte).bit_length() - 1
            token = i * 8 + bit
            if token != eos_token_id:
                return token
            byte &= byte - 1
    return None
