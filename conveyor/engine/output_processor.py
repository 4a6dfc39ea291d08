"""Turns the engine core's per-step ``CoreStepOutput`` into user-facing ``RequestOutput``s.

It owns what core does not: detokenization, stop strings, the grouping of an ``n > 1`` request's completions,
and the per-token timestamps latency metrics need. It never changes the core's state: what a stop string ended,
and what it could not process, are decisions it hands back (``ProcessedOutputs``) for its owner to apply (the
``LLMEngine`` in its own process, or the API process's ``EngineCoreClient``, which sends them to the engine core
process). It reads nothing of the scheduler: the counters it reports travel in the ``CoreOutput``s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.core.outputs import PromptLogprobs
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.core_step import CoreOutput, CoreStepOutput
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class _Child:
    """One completion's output state, and the core's counters for it as of its latest ``CoreOutput``."""

    parent: "_Parent"
    request_id: str
    completion: CompletionOutput
    detok: IncrementalDetokenizer | None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None  # filled as prefill chunks complete
    pooled: list[float] | None = None  # a pooling request's result

    def output(self) -> RequestOutput:
        finished = all(c.completion.finished for c in self.children)
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, [c.completion for c in self.children],
            self.metrics, finished, self.prompt_logprobs, pooled=self.pooled,
        )

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Append a chunk's entries, skipping positions already held (a recomputed prompt, or the second of
        ``n`` completions, scores the same tokens again)."""
        held = len(self.prompt_logprobs)
        assert chunk.start <= held, f"prompt logprobs from position {chunk.start}, only {held} held"
        self.prompt_logprobs.extend(chunk.entries[held - chunk.start:])


@dataclass
class ProcessedOutputs:
    """One step's outputs, the (child) requests a stop string ended (the owner finishes them in the scheduler),
    and the requests whose output could not be processed (parent id -> why; the owner fails them)."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class OutputProcessor:
    """Per-request output state, keyed by the scheduler's (child) request ids.

    ``num_late_tokens`` counts tokens that arrived for a completion already ended here (a stop string or an abort
    ended it, and the core computed more before it heard): the price of deciding those outside the core.
    """

    def __init__(self, tokenizer, detokenize: bool = True) -> None:
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self.children: dict[str, _Child] = {}
        self.parents: dict[str, _Parent] = {}
        self.num_late_tokens = 0

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            children: list[tuple[str, SamplingParams]], arrival: float) -> None:
        """Start tracking a request: its (child id, params) pairs, as ``core_step.child_requests`` makes them."""
        parent = _Parent(request_id, prompt, prompt_token_ids, [], RequestMetrics(arrival))
        if children[0][1].prompt_logprobs is not None:
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
        return ProcessedOutputs(self._collect(touched, step.time), stopped, failed)

    def _apply(self, child: _Child, update: CoreOutput, now: float) -> bool:
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
        """Mark every unfinished completion of a request aborted (the scheduler side is the caller's job);
        ``error``: the request failed (the server reports it as an error, not as an answer)."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if not child.completion.finished:
                child.completion.finish_reason = "abort"
        out = self._collect({request_id: parent}, now)[0]
        out.error = error
        return out

    def forget(self, request_id: str) -> None:
        """Drop a request's output state without a final output (its KV was handed to another engine, which
        reports the rest)."""
        parent = self.parents.pop(request_id, None)
        for child in parent.children if parent else ():
            self.children.pop(child.request_id, None)

    def _collect(self, touched: dict[str, _Parent], now: float) -> list[RequestOutput]:
        outputs = []
        for parent in touched.values():
            m, kids = parent.metrics, parent.children
            firsts = [c.first_scheduled for c in kids if c.first_scheduled is not None]
            m.first_scheduled_time = min(firsts) if firsts else None
            tokens = [c.first_token for c in kids if c.first_token is not None]
            m.first_token_time = min(tokens) if tokens else None
            m.last_token_time = max((c.last_token or 0.0) for c in kids) or None
            m.num_cached_tokens = max(c.num_cached_tokens for c in kids)
            m.num_preemptions = sum(c.num_preemptions for c in kids)
            out = parent.output()
            if out.finished:
                m.finished_time = now
                del self.parents[parent.request_id]
                for child in parent.children:
                    self.children.pop(child.request_id, None)
            outputs.append(out)
        return outputs
