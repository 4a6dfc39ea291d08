"""Turns the engine core's per-step ``CoreStepOutput`` into user-facing ``RequestOutput``s.

It owns what core does not: detokenization, stop strings, the grouping of an ``n > 1`` request's completions,
the per-token timestamps latency metrics need, and each request's output kind (cumulative, or deltas for
streams). It never changes the core's state: what a stop string ended, and what it could not process, are
decisions it hands back for its owner to apply (``settle``: the ``LLMEngine`` in its own process, or the API
process's ``EngineCoreClient``, which sends them to the engine core process). It reads nothing of the scheduler:
the counters it reports travel in the ``RequestUpdate``s.

A step goes through three calls, the same for both owners::

    states  = processor.settle(processor.process(step), finish, now)  # finish(child_ids, status) is the owner's
    outputs = processor.emit(states)   # listeners see every state; each request gets the output it asked for

A *state* is a request's whole output so far (the processor's own objects, cumulative); ``emit`` shows the
states to the ``listeners`` (metrics) and turns each into its request's kind: itself for ``CUMULATIVE``, a fresh
delta for ``DELTA``. Between the two calls an owner may still mark a state (the KV hand-off does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from conveyor.core.outputs import PromptLogprobs, RequestUpdate
from conveyor.core.request import RequestStatus
from conveyor.core.sampling_params import RequestOutputKind, SamplingParams
from conveyor.engine.core_step import CoreStepOutput
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

logger = logging.getLogger("conveyor.engine")

# Ends (child) requests in the scheduler, wherever it runs: ``LLMEngine.finish_requests`` or a message to it.
Finish = Callable[[list[str], RequestStatus], None]


@dataclass
class _Child:
    """One completion's output state, and the core's counters for it as of its latest ``RequestUpdate``."""

    parent: "_Parent"
    request_id: str
    completion: CompletionOutput
    detok: IncrementalDetokenizer | None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    sent_tokens: int = 0  # DELTA: tokens already in an emitted output
    sent_finish: bool = False  # DELTA: its finish already emitted


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    metrics: RequestMetrics
    kind: RequestOutputKind
    prompt_logprobs: list | None = None  # filled as prefill chunks complete
    pooled: list[float] | None = None  # a pooling request's result

    def state(self) -> RequestOutput:
        finished = all(c.completion.finished for c in self.children)
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, [c.completion for c in self.children],
            self.metrics, finished, self.prompt_logprobs, pooled=self.pooled,
        )

    def delta(self, state: RequestOutput) -> RequestOutput | None:
        """What changed since this request's previous output (None: nothing, and it has not finished)."""
        news = []
        for child in self.children:
            comp, start = child.completion, child.sent_tokens
            if len(comp.token_ids) == start and (child.sent_finish or not comp.finished):
                continue
            text_start, text = child.detok.release(comp.finished) if child.detok is not None else (0, "")
            news.append(CompletionOutput(
                comp.index, text, comp.token_ids[start:], comp.finish_reason, comp.stop_reason,
                None if comp.logprobs is None else comp.logprobs[start:], comp.cumulative_logprob,
                comp.token_times[start:], comp.num_preemptions, text_start, start))
            child.sent_tokens, child.sent_finish = len(comp.token_ids), comp.finished
        if not news and not state.finished:
            return None
        return replace(state, outputs=news, metrics=replace(state.metrics), delta=True)

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Append a chunk's entries, skipping positions already held (a recomputed prompt, or the second of
        ``n`` completions, scores the same tokens again)."""
        held = len(self.prompt_logprobs)
        assert chunk.start <= held, f"prompt logprobs from position {chunk.start}, only {held} held"
        self.prompt_logprobs.extend(chunk.entries[held - chunk.start:])


@dataclass
class ProcessedOutputs:
    """One step's states (the requests it changed), the (child) requests a stop string ended (the owner finishes
    them in the scheduler), and the requests whose output could not be processed (parent id -> why; the owner
    fails them). ``OutputProcessor.settle`` applies the last two."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class OutputProcessor:
    """Per-request output state, keyed by the scheduler's (child) request ids.

    ``listeners`` are called by ``emit`` with every request's state (cumulative, this processor's own object:
    read it in the call, keep nothing of it); ``ServedEngine.output_listeners`` is this list.
    ``num_late_tokens`` counts tokens that arrived for a completion already ended here (a stop string or an abort
    ended it, and the core computed more before it heard): the price of deciding those outside the core.
    """

    def __init__(self, tokenizer, detokenize: bool = True,
                 listeners: list[Callable[[RequestOutput], None]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self.listeners: list[Callable[[RequestOutput], None]] = [] if listeners is None else listeners
        self.children: dict[str, _Child] = {}
        self.parents: dict[str, _Parent] = {}
        self.num_late_tokens = 0

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            children: list[tuple[str, SamplingParams]], arrival: float) -> None:
        """Start tracking a request: its (child id, params) pairs, as ``core_step.child_requests`` makes them."""
        first = children[0][1]
        parent = _Parent(request_id, prompt, prompt_token_ids, [], RequestMetrics(arrival), first.output_kind)
        if first.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for index, (child_id, params) in enumerate(children):
            detok = None
            if self.detokenize and params.pooling is None:  # a pooling request's only output is its result
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output,
                    params.skip_special_tokens,
                )
            completion = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
            child = _Child(parent, child_id, completion, detok)
            parent.children.append(child)
            self.children[child_id] = child
        self.parents[request_id] = parent

    def parent_id(self, child_id: str) -> str | None:
        child = self.children.get(child_id)
        return None if child is None else child.parent.request_id

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.request_id for c in parent.children] if parent else []

    def unfinished_child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.request_id for c in parent.children if not c.completion.finished] if parent else []

    def process(self, step: CoreStepOutput) -> ProcessedOutputs:
        for req_id, chunk in step.prompt_logprobs.items():  # before the updates: outputs carry them
            child = self.children.get(req_id)
            if child is not None and child.parent.prompt_logprobs is not None:
                child.parent.add_prompt_logprobs(chunk)
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        failed: dict[str, str] = {}
        for child_id, why in step.failed.items():
            parent_id = self.parent_id(child_id)
            if parent_id is not None:
                failed.setdefault(parent_id, why)
        for update in step.outputs:
            child = self.children.get(update.request_id)
            if child is None or child.completion.finished:
                self.num_late_tokens += 1
                continue
            if child.parent.request_id in failed:
                continue
            try:
                stop_hit = self._apply(child, update, step.time)
            except Exception as exc:  # noqa: BLE001 - one request's detokenizer must not stop the step
                failed[child.parent.request_id] = f"could not detokenize its output: {exc!r}"
                touched.pop(child.parent.request_id, None)
                continue
            if stop_hit:
                stopped.append(update.request_id)
            touched[child.parent.request_id] = child.parent
        return ProcessedOutputs(self._states(touched, step.time), stopped, failed)

    def settle(self, processed: ProcessedOutputs, finish: Finish, now: float) -> list[RequestOutput]:
        """Apply what ``process`` decided and return the step's states: the requests a stop string ended are
        finished in the scheduler (``finish``); a request that failed is finished there too (its unfinished
        completions aborted), and its state becomes its final one, carrying the error."""
        if processed.stopped:
            finish(processed.stopped, RequestStatus.FINISHED_STOPPED)
        states = processed.request_outputs
        if processed.failed:
            states = [o for o in states if o.request_id not in processed.failed]
            for request_id, why in processed.failed.items():
                logger.error("request %s failed and was aborted: %s", request_id, why)
                children = self.unfinished_child_ids(request_id)
                if children:
                    finish(children, RequestStatus.FINISHED_ABORTED)
                if (out := self.abort(request_id, now, why)) is not None:
                    states.append(out)
        return states

    def emit(self, states: list[RequestOutput]) -> list[RequestOutput]:
        """Show the states to the listeners, then make each request's output of its kind; a finished state is
        its request's last (forgotten here)."""
        for state in states:
            for listener in self.listeners:
                listener(state)
        outputs = []
        for state in states:
            parent = self.parents.get(state.request_id)
            out = state
            if parent is not None and parent.kind is RequestOutputKind.DELTA:
                out = parent.delta(state)
            if state.finished:
                self.forget(state.request_id)
            if out is not None:
                outputs.append(out)
        return outputs

    def _apply(self, child: _Child, update: RequestUpdate, now: float) -> bool:
        """Add the update to its completion; True when a stop string ended a request the scheduler still runs."""
        comp = child.completion
        child.num_cached_tokens, child.num_preemptions = update.num_cached_tokens, update.num_preemptions
        child.first_scheduled = update.first_scheduled
        if child.first_token is None:
            child.first_token = now
        child.last_token = now
        if update.pooled is not None:  # a prefill-only request's result: no token
            child.parent.pooled = update.pooled
            comp.finish_reason = update.finish_reason
            return False
        comp.token_ids.append(update.new_token_id)
        comp.token_times.append(now)
        if update.logprobs is not None and comp.logprobs is not None:
            comp.logprobs.append(update.logprobs)
            comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + update.logprobs.logprob
        stop_str = None
        if child.detok is not None:
            stop_str = child.detok.add_token(update.new_token_id)
            comp.text = child.detok.text
        if update.finish_reason is not None:
            comp.finish_reason, comp.stop_reason = update.finish_reason, update.stop_reason
        elif stop_str is not None:
            comp.finish_reason, comp.stop_reason = "stop", stop_str
        if comp.finished:
            comp.num_preemptions = child.num_preemptions
        return stop_str is not None and update.finish_reason is None

    def abort(self, request_id: str, now: float, error: str | None = None) -> RequestOutput | None:
        """Mark every unfinished completion of a request aborted and return its final state, for ``emit`` (the
        scheduler side is the caller's job); ``error``: the request failed (the server reports it as an error,
        not as an answer)."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if not child.completion.finished:
                child.completion.finish_reason = "abort"
        out = self._states({request_id: parent}, now)[0]
        out.error = error
        return out

    def forget(self, request_id: str) -> None:
        """Drop a request's output state without a final output (refused, or its KV was handed to another
        engine, which reports the rest)."""
        parent = self.parents.pop(request_id, None)
        for child in parent.children if parent else ():
            self.children.pop(child.request_id, None)

    def _states(self, touched: dict[str, _Parent], now: float) -> list[RequestOutput]:
        states = []
        for parent in touched.values():
            m, kids = parent.metrics, parent.children
            firsts = [c.first_scheduled for c in kids if c.first_scheduled is not None]
            m.first_scheduled_time = min(firsts) if firsts else None
            tokens = [c.first_token for c in kids if c.first_token is not None]
            m.first_token_time = min(tokens) if tokens else None
            m.last_token_time = max((c.last_token or 0.0) for c in kids) or None
            m.num_cached_tokens = max(c.num_cached_tokens for c in kids)
            m.num_preemptions = sum(c.num_preemptions for c in kids)
            state = parent.state()
            if state.finished:
                m.finished_time = now
            states.append(state)
        return states
