"""Turns the scheduler's per-step ``RequestUpdate``s into user-facing ``RequestOutput``s.

It owns what core does not: detokenization, stop strings, the grouping of an ``n > 1`` request's completions,
and the per-token timestamps latency metrics need. It never changes the core's state: what a stop string ended,
and what it could not process, are decisions it hands back (``ProcessedOutputs``) for the engine to apply. (It
reads the core ``Request``s it was given, for their timestamps and counts.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.core.outputs import PromptLogprobs, RequestUpdate
from conveyor.core.request import Request
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class _Child:
    parent: "_Parent"
    request: Request
    completion: CompletionOutput
    detok: IncrementalDetokenizer | None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None  # filled as prefill chunks complete

    def output(self) -> RequestOutput:
        finished = all(c.completion.finished for c in self.children)
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, [c.completion for c in self.children],
            self.metrics, finished, self.prompt_logprobs,
        )

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Append a chunk's entries, skipping positions already held (a recomputed prompt, or the second of
        ``n`` completions, scores the same tokens again)."""
        held = len(self.prompt_logprobs)
        assert chunk.start <= held, f"prompt logprobs from position {chunk.start}, only {held} held"
        self.prompt_logprobs.extend(chunk.entries[held - chunk.start:])


@dataclass
class ProcessedOutputs:
    """One step's outputs, the (child) requests a stop string ended (the engine finishes them), and the
    requests whose output could not be processed (parent id -> why; the engine fails them)."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class OutputProcessor:
    """Per-request output state, keyed by the scheduler's (child) request ids."""

    def __init__(self, tokenizer, detokenize: bool = True) -> None:
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self.children: dict[str, _Child] = {}
        self.parents: dict[str, _Parent] = {}

    def add(self, request_id: str, prompt: str | None, requests: list[Request], arrival: float) -> None:
        parent = _Parent(request_id, prompt, requests[0].prompt_token_ids, [], RequestMetrics(arrival))
        if requests[0].sampling_params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for index, req in enumerate(requests):
            params = req.sampling_params
            detok = None
            if self.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, params.stop, params.include_stop_str_in_output,
                    params.skip_special_tokens,
                )
            completion = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
            child = _Child(parent, req, completion, detok)
            parent.children.append(child)
            self.children[req.request_id] = child
        self.parents[request_id] = parent

    def parent_id(self, child_id: str) -> str | None:
        child = self.children.get(child_id)
        return None if child is None else child.parent.request_id

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def process(self, updates: list[RequestUpdate], now: float,
                prompt_logprobs: dict[str, PromptLogprobs] | None = None) -> ProcessedOutputs:
        for req_id, chunk in (prompt_logprobs or {}).items():  # before the updates: outputs carry them
            child = self.children.get(req_id)
            if child is not None and child.parent.prompt_logprobs is not None:
                child.parent.add_prompt_logprobs(chunk)
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        failed: dict[str, str] = {}
        for update in updates:
            child = self.children.get(update.request_id)
            if child is None or child.parent.request_id in failed:
                continue
            try:
                stop_hit = self._apply(child, update, now)
            except Exception as exc:  # noqa: BLE001 - one request's detokenizer must not stop the step
                failed[child.parent.request_id] = f"could not detokenize its output: {exc!r}"
                touched.pop(child.parent.request_id, None)
                continue
            if stop_hit:
                stopped.append(update.request_id)
            touched[child.parent.request_id] = child.parent
        return ProcessedOutputs(self._collect(touched, now), stopped, failed)

    def _apply(self, child: _Child, update: RequestUpdate, now: float) -> bool:
        """Add the update to its completion; True when a stop string ended a request the scheduler still runs."""
        comp, req = child.completion, child.request
        assert update.new_token_id is not None
        comp.token_ids.append(update.new_token_id)
        comp.token_times.append(now)
        if update.logprobs is not None and comp.logprobs is not None:
            comp.logprobs.append(update.logprobs)
            comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + update.logprobs.logprob
        stop_str = None
        if child.detok is not None:
            stop_str = child.detok.add_token(update.new_token_id)
            comp.text = child.detok.text
        if update.finished:
            comp.finish_reason, comp.stop_reason = update.finish_reason, update.stop_reason
        elif stop_str is not None:
            comp.finish_reason, comp.stop_reason = "stop", stop_str
        if comp.finished:
            comp.num_preemptions = req.num_preemptions
        return stop_str is not None and not update.finished

    def abort(self, request_id: str, now: float) -> RequestOutput | None:
        """Mark every unfinished completion of a request aborted (the scheduler side is the caller's job)."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if not child.completion.finished:
                child.completion.finish_reason = "abort"
        return self._collect({request_id: parent}, now)[0]

    def _collect(self, touched: dict[str, _Parent], now: float) -> list[RequestOutput]:
        outputs = []
        for parent in touched.values():
            m, reqs = parent.metrics, [c.request for c in parent.children]
            firsts = [r.times.first_scheduled for r in reqs if r.times.first_scheduled is not None]
            m.first_scheduled_time = min(firsts) if firsts else None
            tokens = [r.times.first_token for r in reqs if r.times.first_token is not None]
            m.first_token_time = min(tokens) if tokens else None
            m.last_token_time = max((r.times.last_token or 0.0) for r in reqs) or None
            m.num_cached_tokens = max(r.num_cached_prompt_tokens for r in reqs)
            m.num_preemptions = sum(r.num_preemptions for r in reqs)
            out = parent.output()
            if out.finished:
                m.finished_time = now
                del self.parents[parent.request_id]
                for child in parent.children:
                    self.children.pop(child.request.request_id, None)
            outputs.append(out)
        return outputs
