"""``LLMEngine``: builds the tokenizer, model runner, KV manager and scheduler, and runs one step at a time.

``step()`` is three calls: ``scheduler.schedule(now)``, ``executor.execute(...)``, ``scheduler.update(...)``;
then the output processor detokenizes and checks stop strings, and the engine finishes in the scheduler what
a stop string ended. The engine is the layer that reads the clock (``time.monotonic()``) and passes it down.

What it wires and where each piece lives: the device and CPU placement (``engine.placement``), the loaded model
(``engine.loaded_model``), constrained requests waiting for their grammar (``structured.gate.GrammarGate``) and
the KV hand-off of disaggregated serving (``engine.kv_handoff.KVHandoffs``).
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from conveyor.core.interfaces import EngineExecutor
from conveyor.core.outputs import RequestUpdate
from conveyor.core.policies.queue_bound import QueueBound
from conveyor.core.request import Request, RequestStatus
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler
from conveyor.engine.args import EngineArgs
from conveyor.engine.core_step import CoreStepOutput, child_requests
from conveyor.engine.engine_client import EngineInfo, QueueFullError  # noqa: F401  (raised here, and its old home)
from conveyor.engine.heap import release_free_heap
from conveyor.engine.kv_handoff import KVHandoff, KVHandoffs, check_fits, decode_request
from conveyor.engine.loaded_model import LoadedModel, load_draft
from conveyor.engine.output_processor import OutputProcessor
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.placement import place, step_pinning
from conveyor.engine.sizing import context_length, make_kv_manager, num_kv_blocks
from conveyor.engine.pooling import check_pooling_input, check_task, make_pooler
from conveyor.engine.prompts import PromptType, encode_text, prompt_tokens, tokenize_bad_words
from conveyor.engine.step_cut import StepCutter
from conveyor.engine.step_record import StepRecord
from conveyor.structured.gate import GrammarGate
from conveyor.structured.manager import StructuredOutputs

if TYPE_CHECKING:
    from conveyor.models.step_cut import CutFlag


class LLMEngine:
    """A synchronous engine. Not thread-safe: ``AsyncEngine`` serialises access to it."""

    def __init__(self, args: EngineArgs | None = None, executor: EngineExecutor | None = None,
                 shared_model: LoadedModel | None = None, **overrides) -> None:
        start = time.perf_counter()
        self.args = args = args or EngineArgs(**overrides)
        self.device = place(args)
        loaded = shared_model or LoadedModel.load(args, self.device)  # shared: see sharing_model()
        self.model, self.model_info, self.tokenizer = loaded
        self.load_time_s = time.perf_counter() - start  # tokenizer + weights (read, dequantized, laid out)
        self.max_model_len = context_length(args, self.model_info)
        draft = load_draft(args, self.device, self.model_info, self.max_model_len)
        cache = args.cache_config()
        self.num_kv_blocks = num_blocks = num_kv_blocks(args, cache, self.model_info, draft, self.max_model_len)
        self.kv_manager = make_kv_manager(cache, num_blocks, self.max_model_len, self.model_info, draft)
        self.scheduler = Scheduler(args.scheduler_config(self.max_model_len, whole_prompts=not self.model_info.causal),
                                   self.kv_manager)
        # Constrained decoding: grammars compile on a thread of their own; a constrained request waits in the gate,
        # outside the scheduler, until its grammar is ready.
        self.structured = StructuredOutputs(self.tokenizer, self.model_info.vocab_size)
        self.grammar_gate = GrammarGate()
        self.queue_bound = (QueueBound(args.max_num_queued_reqs, self.scheduler.config.max_num_seqs)
                            if args.max_num_queued_reqs is not None else None)
        # cut_flag: the runner's, if it can stop a forward between layers (models.step_cut); never a given executor's
        cut_flag = None
        if executor is None:
            executor, cut_flag = self._make_runner(num_blocks, cache.block_size, draft)
        self.executor = executor  # (an assignment of the annotated parameter: tests/test_protocols.py reads it)
        self._pinned = step_pinning(self.device, args)  # a step's thread binding (CPU: kernels.binding)
        self.output_processor = OutputProcessor(self.tokenizer, detokenize=args.detokenize)
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self.handoffs = KVHandoffs(self.scheduler, self.executor, self.kv_manager)  # disaggregated prefill/decode
        # Steps an arrival that outranks them may cut short (engine.step_cut); None: off, or not this executor
        self.step_cutter = StepCutter.build(self.scheduler.config.scheduling_policy, args.priority_step_cut,
                                            cut_flag, self.model_info.num_layers)
        self._ids = itertools.count()
        release_free_heap()  # what loading freed stays resident in glibc's heap until trimmed (engine.heap)
        self.init_time_s = time.perf_counter() - start  # plus the KV cache and runner

    def _make_runner(self, num_blocks: int, block_size: int, draft) -> tuple[EngineExecutor, CutFlag | None]:
        """The engine's own model runner, and the flag that can stop its forward between layers (None: it cannot)."""
        from conveyor.runner.model_runner import ModelRunner

        args = self.args
        runner = ModelRunner(
            self.model, self.model_info, num_blocks=num_blocks, block_size=block_size, device=self.device,
            attention_backend=args.attention_backend, seed=args.seed,  # --seed seeds sampling too, as in vLLM
            structured=self.structured, pooler=make_pooler(self.model, self.model_info, self.tokenizer),
            null_block_id=self.kv_manager.null_block_id, kv_cache_dtype=args.kv_cache_dtype)
        if draft is not None:
            runner.attach_draft(*draft, args.attention_backend)
        if args.enable_lora:
            if args.max_loras < 1 or args.max_lora_rank < 1:
                raise ValueError(f"--max-loras and --max-lora-rank must be >= 1, got {args.max_loras} and "
                                 f"{args.max_lora_rank}")
            runner.attach_lora(args.max_loras, args.max_lora_rank)
        if args.cuda_graphs:  # after the draft and LoRA: it refuses the one and keeps the other's steps eager
            runner.attach_decode_graphs(args.max_num_seqs)
        return runner, runner.attach_step_cut()

    @classmethod
    def sharing_model(cls, other: LLMEngine, args: EngineArgs) -> LLMEngine:
        """A fresh engine (scheduler, KV cache, runner) on ``other``'s loaded model and tokenizer.

        For benchmarks that compare configurations in one process: the weights are loaded once. ``args`` must
        name the same model, dtype and device; scheduling and cache knobs may differ.
        """
        for name in ("model", "dtype", "device", "seed"):
            if getattr(args, name) != getattr(other.args, name):
                raise ValueError(f"sharing_model: {name} differs: {getattr(args, name)!r} vs "
                                 f"{getattr(other.args, name)!r}")
        return cls(args, shared_model=LoadedModel(other.model, other.model_info, other.tokenizer))

    @functools.cached_property
    def info(self) -> EngineInfo:
        """This engine's facts fixed for the run, as a server reads them of any engine (``ServedEngine.info``)."""
        from conveyor.models import EMBEDDED_NAME
        from conveyor.models.flops import prefix_hit_flops

        return EngineInfo(self.args, self.tokenizer, self.model_info, self.max_model_len, self.max_seqs_per_request,
                          self.num_kv_blocks, os.getpid(), self.load_time_s, self.init_time_s,
                          self.model_info.name == EMBEDDED_NAME, prefix_hit_flops(self.model_info))

    # ---- requests ---------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt as (text or None, token ids): a string, a list of ids, or ``{"prompt_token_ids": [...]}``."""
        return prompt_tokens(self.tokenizer, prompt)

    def encode(self, text: str, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        """Token ids of ``text`` (see ``prompts.encode_text``)."""
        return encode_text(self.tokenizer, text, add_special_tokens, field)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when a request cannot be served by this model: an empty or too long prompt, ids
        outside the vocabulary, ``min_tokens`` that do not fit in the context, a pooling request to a model that
        does not pool or a generation request to one that only does (``pooling.check_task``).

        ``max_tokens`` beyond the remaining context is not an error here: ``Request.max_output_tokens`` caps it
        (the OpenAI server is stricter and refuses it, as vLLM's does). ``min_tokens`` is a promise, so it is."""
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if params.priority != 0 and self.scheduler.config.scheduling_policy != "priority":
            raise ValueError(f"priority is {params.priority}, but this engine serves requests in arrival order "
                             f"(--scheduling-policy {self.scheduler.config.scheduling_policy}); send 0 or none")
        check_task(self.model_info, params.pooling)
        if params.lora is not None and not self.args.enable_lora:
            raise ValueError(f"lora: this engine serves no LoRA adapter (start it with --enable-lora); asked for "
                             f"{params.lora.lora_name!r}")
        if params.lora is not None and params.pooling is not None:
            raise ValueError("lora: pooling requests run on the base model only")
        if params.pooling is not None:  # prefill-only: the whole context is the prompt's
            check_pooling_input(token_ids, self.max_model_len, self.model_info.vocab_size)
            return
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens, which leaves no room to generate within this model's "
                f"maximum context length of {self.max_model_len} tokens"
            )
        vocab = self.model_info.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) + params.min_tokens > self.max_model_len:
            raise ValueError(
                f"min_tokens is {params.min_tokens} and the prompt has {len(token_ids)} tokens: together they "
                f"exceed this model's maximum context length of {self.max_model_len} tokens"
            )
        params.check_vocabulary(vocab)
        if params.kv_budget_tokens is not None and self.scheduler.evictor is None:
            raise ValueError("kv_budget_tokens needs a KV eviction policy: this engine runs with --kv-eviction none")

    @property
    def max_seqs_per_request(self) -> int | None:
        """With a queue bound: the most sequences one request can ever bring (``QueueBound``). None: no bound."""
        return None if self.queue_bound is None else self.queue_bound.max_seqs_per_request

    def _check_queue_room(self, num_seqs: int) -> None:
        """The queue bound counts what waits: sequences that will not find a free seat at the next step."""
        bound = self.queue_bound
        if bound is None:
            return
        if (never := bound.never_admits(num_seqs)) is not None:
            raise ValueError(never)
        if not bound.has_room(num_seqs, self.scheduler.num_running,
                              self.scheduler.num_waiting + len(self.grammar_gate)):
            raise QueueFullError(f"the waiting queue is full ({bound.bound} requests); retry later")

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a request; return its id. Raises ValueError (bad input) or QueueFullError (queue bound)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        now = time.monotonic() if arrival_time is None else arrival_time
        children = self.add_core_request(request_id, token_ids, params, now)
        self.output_processor.add(request_id, text, token_ids, children, now)
        return request_id

    def add_core_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                         arrival: float) -> list[tuple[str, SamplingParams]]:
        """The scheduler's half of ``add_request`` (what the engine core process runs): check, then queue the
        request's (child) requests; returns their (id, params). Raises ValueError or QueueFullError."""
        self._check_queue_room(params.n)
        self.validate_prompt(token_ids, params)
        if params.bad_words and not params.bad_words_token_ids:
            params.bad_words_token_ids = tokenize_bad_words(self.tokenizer, params.bad_words)
        children = child_requests(request_id, params)
        if any(child_id in self.scheduler.requests or child_id in self.grammar_gate for child_id, _ in children):
            raise ValueError(f"request id {request_id!r} is already in use")
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured.compile(params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:  # a cached failure
                raise ValueError(str(grammar.exception()))
        eos = tuple(self.model_info.eos_token_ids)
        for child_id, child_params in children:
            request = Request(child_id, token_ids, child_params, eos, self.max_model_len, arrival,
                              share_prefix=params.n > 1)
            if grammar is None or grammar.done():
                self.scheduler.add_request(request)
            else:
                self.grammar_gate.hold(grammar, request)
        return children

    def finish_requests(self, child_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End these (child) requests in the scheduler (no-op for finished ones); their blocks are free when this
        returns. The output side decided it (a stop string, an abort, a failure) and keeps its own state."""
        now = time.monotonic()
        self.grammar_gate.drop(child_ids)
        for child_id in child_ids:
            self.scheduler.finish_request(child_id, status, now)
        if self.handoffs:
            self.handoffs.drop(child_ids)

    def abort_request(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Abort every completion of a request; its blocks are free when this returns. Returns its last output
        (None when it had finished)."""
        processor = self.output_processor
        self.finish_requests(processor.child_ids(request_id))
        state = processor.abort(request_id, time.monotonic(), error)
        return next(iter(processor.emit([state])), None) if state is not None else None

    def has_unfinished_requests(self) -> bool:
        return bool(self.grammar_gate) or self.scheduler.has_unfinished_requests()

    # ---- disaggregated prefill / decode (engine.kv_handoff) ---------------------------------------------
    def add_prefill_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                            arrival_time: float | None = None) -> str:
        """Queue a request to run here only until its first token: then its KV is exported and its blocks freed
        in the same step, and its last output (``finished``, the first token in it) carries ``kv_handoff`` for
        ``add_handoff`` on a decode engine. One that finishes at its first token ends here, without one. Raises
        ValueError for what ``kv_handoff.can_hand_off`` refuses, as ``add_request`` does for bad input."""
        params = params or SamplingParams()
        self.handoffs.check(params)
        request_id = self.add_request(request_id, prompt, params, arrival_time)
        self.handoffs.exporting.add(request_id)
        return request_id

    def add_handoff(self, handoff: KVHandoff, arrival_time: float | None = None) -> str:
        """Queue a request a prefill engine started (``add_prefill_request``): admitted as a decode whose prompt
        KV is copied into the blocks the scheduler gives it, it generates from its second token on; its outputs
        are cumulative from the first token. Raises ValueError (another model's KV, a bad prompt, an id in use)
        or QueueFullError."""
        h, params = handoff, handoff.sampling_params
        rid, prompt = h.request_id, list(handoff.prompt_token_ids)
        self.handoffs.check(params)
        if rid in self.output_processor.parents or rid in self.scheduler.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        check_fits(h, self.model_info)
        self._check_queue_room(1)
        self.validate_prompt(prompt, params)
        now = time.monotonic() if arrival_time is None else arrival_time
        self.handoffs.admit(h, decode_request(h, tuple(self.model_info.eos_token_ids), self.max_model_len, now))
        processor = self.output_processor
        processor.add(rid, h.prompt, prompt, [(rid, params)], now)
        # The first token as the prefill side's output processor took it: text, logprobs, stop-string state (and,
        # for a stream, as given to the client: the prefill side's last output held it).
        processor.emit(processor.process(CoreStepOutput(now, [RequestUpdate(
            rid, h.first_token_id, h.first_logprobs, num_cached_tokens=h.num_cached_tokens)])).request_outputs)
        return rid

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule, execute, update, then output processing. Returns the requests that
        progressed."""
        core = self.core_step()
        if core is None:
            return []
        processor = self.output_processor
        states = processor.settle(processor.process(core), self.finish_requests, core.time)
        if self.handoffs.exporting:
            self.handoffs.export_first_tokens(states)
        return processor.emit(states)

    def core_step(self) -> CoreStepOutput | None:
        """The engine core's half of ``step()``: schedule, execute, update; each sampled token as a
        ``RequestUpdate`` (None when nothing was scheduled). What the engine core process runs and sends."""
        start = time.monotonic()
        cutter = self.step_cutter
        if cutter is not None:
            cutter.begin()
        grammar_failed = self.grammar_gate.admit_ready(self.scheduler.add_request)
        sched_out = self.scheduler.schedule(start)
        if sched_out.is_empty:
            return CoreStepOutput(start, failed=grammar_failed) if grammar_failed else None
        if self.handoffs.importing:
            self.handoffs.write_admitted(sched_out)
        record = StepRecord.before(start, sched_out, self.scheduler) if self.step_listeners else None
        with self._pinned():
            if cutter is None or self.handoffs.importing:
                model_out = self.executor.execute(sched_out)
            else:
                model_out = cutter.run(sched_out, self.scheduler, lambda: self.executor.execute(sched_out), start)
        if model_out is None:  # cut short for an arrival: dropped as if it never ran, the next step admits it
            if self.args.debug_invariants:
                self.scheduler.check_invariants()
            return CoreStepOutput(time.monotonic(), failed=grammar_failed)
        now = time.monotonic()
        outputs = self.scheduler.update(sched_out, model_out, now)
        if self.args.debug_invariants:
            self.scheduler.check_invariants()
        if record is not None:
            record.finish(now, self.scheduler)
            for listener in self.step_listeners:
                listener(record)
        return CoreStepOutput(now, outputs, model_out.prompt_logprobs, {**grammar_failed, **model_out.failed})

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (benchmarks: a repeat must not reuse the previous run's prompts)."""
        if self.has_unfinished_requests():
            raise RuntimeError("reset_prefix_cache needs an idle engine")
        self.kv_manager.reset_prefix_cache()
