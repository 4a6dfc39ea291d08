"""ModelRunner: the torch executor. ``execute(SchedulerOutput) -> ModelOutput``, one forward pass per step."""

from __future__ import annotations

import torch

from concurrent.futures import Future, ThreadPoolExecutor

from conveyor.core.outputs import ModelOutput, PromptLogprobs, SchedulerOutput
from conveyor.layers.attention import allocate_kv_caches, backend_class, make_attention, resolve_backend
from conveyor.layers.attention.kv_quant import row_bytes as kv_row_bytes
from conveyor.models.build import ModelInfo, resolve_dtype
from conveyor.models.decoder import DecoderForCausalLM
from conveyor.models.step_cut import CutFlag
from conveyor.runner.input_batch import InputBatch, PromptRows, StepInputs
from conveyor.runner.kv_io import gather_kv, scatter_kv
from conveyor.runner.pooler import Pooler
from conveyor.runner.sampler import Sampler, prompt_logprobs
from conveyor.runner.spec_verify import verify_proposals
from conveyor.structured.grammars import error_text

PROMPT_LOGITS_ROWS = 256  # prompt logprobs in slices: [256, 49152] float32 logits are 50 MB


class ModelRunner:
    """Owns the paged KV cache and the per-request state; runs the model and samples (``core.Executor``).

    The KV cache is one tensor per layer in the attention backend's layout (``AttentionBackendType.kv_layout``);
    block b covers cache slots [b * block_size, (b + 1) * block_size). A step is ``forward`` (the logits of the rows that sample, and the
    logprobs of prompt tokens for requests that asked) then ``sample``.
    """

    def __init__(self, model: torch.nn.Module, info: ModelInfo, num_blocks: int, block_size: int,
                 device: str | torch.device = "cpu", attention_backend: str = "auto", seed: int = 0,
                 structured=None, pooler: Pooler | None = None, null_block_id: int | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        """``null_block_id`` (the KV manager's, when it gives back blocks outside a sliding window): one more block
        is allocated for it, zeroed, and the table entries of given-back blocks point at it. ``kv_cache_dtype``:
        "auto" (the model's dtype) or "int8" (``layers.attention.kv_quant``; the backend must read it)."""
        self.model, self.info = model, info
        self.kv_cache_dtype = kv_cache_dtype
        self.device = torch.device(device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.null_block_id = null_block_id
        self.dtype = resolve_dtype(info.dtype)
        # Resolved (and the native kernels built or loaded) here, while the engine starts: not in a request.
        self.backend = resolve_backend(attention_backend, self.device, self.dtype, info.head_dim, block_size)
        # A bidirectional encoder keeps no K/V: each sequence runs whole in one step (the blocks the scheduler
        # gives it are bookkeeping of the tokens in flight)
        self.kv_caches = self._allocate_kv(self.backend, info) if info.causal else []
        self.structured = structured  # conveyor.structured.StructuredOutputs (None: no constrained requests)
        self.batch = InputBatch(block_size, self.device, max_position=info.max_position_embeddings,
                                structured=structured, token_types=info.type_vocab_size > 0,
                                null_block_id=null_block_id)
        self.pooler = pooler  # a pooling model's (runner.pooler): embedding and scoring requests' results
        self._pooled: dict[str, list[float]] = {}  # the step's pooled results, from forward to execute
        # The constrained rows' bitmasks are filled on this thread while the forward pass runs.
        self._mask_filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-bitmask")
        self.sampler = Sampler(info.eos_token_ids, self.device, seed)
        self.kv_layout = backend_class(self.backend).kv_layout  # how the hand-over reads and writes the caches
        # Handed-over requests' sampling generators, set once the batch has built their state (``import_kv``).
        self._imported_generators: dict[str, torch.Tensor] = {}
        self._scored_attention = None  # the step's scoring attention (block_scores) while its scores wait to be returned
        self.draft = None  # runner.draft_model.DraftModel (attach_draft): fills the scheduler's placeholders
        self.lora = None  # runner.lora_slots.LoRASlots (attach_lora): each step's rows of each LoRA adapter
        self.decode_graphs = None  # runner.decode_graphs.DecodeGraphs (attach_decode_graphs): replayed decode steps

    def attach_decode_graphs(self, max_num_seqs: int, capture: bool = True) -> None:
        """Run decode-only steps of up to ``max_num_seqs`` requests through CUDA graphs captured now (``--cuda-graphs``;
        ``capture=False``: through the same padded buffers without a graph, the CPU tests' way)."""
        from conveyor.runner.decode_graphs import DecodeGraphs

        if not backend_class(self.backend).graph_capturable or (capture and self.device.type != "cuda"):
            raise ValueError(f"--cuda-graphs needs a CUDA device and the triton attention backend; this engine runs "
                             f"{self.backend!r} on {self.device}")
        if self.draft is not None or not self.info.causal:
            raise ValueError("--cuda-graphs does not run beside a draft model, nor for an encoder")
        max_blocks = -(-self.info.max_position_embeddings // self.block_size) + 1

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
            return self.model(input_ids, positions, self.kv_caches, make_attention(self.backend, meta, self.dtype))

        self.decode_graphs = DecodeGraphs(forward, max_num_seqs, max_blocks, self.block_size, self.device, capture)

    def attach_step_cut(self) -> CutFlag | None:
        """Let another thread cut a step's forward short between layers (``models.step_cut``): the flag, or None
        where a forward cannot stop cleanly (a model other than the decoder stack, a draft model proposing in the
        step, replayed CUDA graphs)."""
        if not isinstance(self.model, DecoderForCausalLM) or self.draft is not None or self.decode_graphs is not None:
            return None
        self.model.cut_flag = CutFlag()
        return self.model.cut_flag

    def attach_draft(self, model: torch.nn.Module, info: ModelInfo, attention_backend: str = "auto") -> None:
        """Propose with ``model`` (speculative decoding's draft model), on this runner's blocks."""
        from conveyor.runner.draft_model import DraftModel

        self.draft = DraftModel(model, info, self.block_size, self.device, attention_backend, self._allocate_kv)

    def attach_lora(self, max_loras: int, max_rank: int, segmented: bool = True) -> None:
        """Serve LoRA adapters: ``max_loras`` adapter slots of rank up to ``max_rank`` on this runner's model
        (``models.lora_model``; ``segmented=False``: the torch per-adapter loop instead of the native kernel)."""
        from conveyor.models.lora_model import LoRAModel
        from conveyor.runner.lora_slots import LoRASlots

        kernels = None
        if self.device.type == "cpu":
            from conveyor.kernels import load_cpu_kernels

            kernels = load_cpu_kernels()
        self.lora = LoRASlots(LoRAModel(self.model, max_loras, max_rank, self.device, kernels, segmented))

    def _allocate_kv(self, backend: str, info: ModelInfo) -> list[torch.Tensor]:
        """A model's per-layer caches over this runner's blocks, the null block (zeroed: a masked key's weight
        times its V must stay 0, which uninitialised memory's NaN would break) included."""
        num_blocks = self.num_blocks if self.null_block_id is None else max(self.num_blocks, self.null_block_id + 1)
        caches = allocate_kv_caches(backend, info.num_layers, num_blocks, self.block_size, info.num_kv_heads,
                                    info.head_dim, resolve_dtype(info.dtype), self.device, self.kv_cache_dtype)
        if self.null_block_id is not None:
            for cache in caches:  # [2, num_blocks, ...] in every backend's layout
                cache[:, self.null_block_id].zero_()
        return caches

    @staticmethod
    def kv_cache_bytes_per_block(info: ModelInfo, block_size: int, kv_cache_dtype: str = "auto") -> int:
        """Bytes one KV block takes over all layers (K and V), to size num_blocks from a memory budget (0 for an
        encoder, which keeps none); an int8 cache's rows hold their scales too (``kv_quant``)."""
        if not info.causal:
            return 0
        row = kv_row_bytes(info.head_dim, kv_cache_dtype, resolve_dtype(info.dtype))
        return 2 * info.num_layers * block_size * info.num_kv_heads * row

    def _failed(self, so: SchedulerOutput) -> dict[str, str]:
        """This step's new requests whose per-request setup failed (they are failed once, when first seen)."""
        states = (self.batch.requests.get(r.request_id) for r in so.scheduled_new_reqs)
        return {s.req_id: s.error for s in states if s is not None and s.error is not None}

    # ---- KV hand-over (disaggregated prefill / decode: engine.kv_handoff) -------------------------------
    def export_kv(self, request_id: str, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor,
                                                                                           torch.Tensor | None]:
        """The K/V of a request's first ``num_tokens`` tokens (``runner.kv_io``'s wire form, on the CPU) and its
        seeded generator's state (None when unseeded), to continue it on another engine."""
        kv = gather_kv(self.kv_caches, block_ids, num_tokens, self.block_size, self.kv_layout)
        state = self.batch.requests.get(request_id)
        gen = state.generator.get_state() if state is not None and state.generator is not None else None
        return kv, gen

    def import_kv(self, request_id: str, block_ids: list[int], kv: torch.Tensor,
                  generator_state: torch.Tensor | None) -> None:
        """Write a handed-over request's K/V into its blocks (call after ``schedule`` admitted it, before the
        ``execute`` that first sees it); its generator takes ``generator_state`` in that ``execute``."""
        scatter_kv(self.kv_caches, block_ids, kv, self.block_size, self.kv_layout, skip_block=self.null_block_id)
        if generator_state is not None:
            self._imported_generators[request_id] = generator_state

    def _restore_generators(self) -> None:
        for rid, gen_state in self._imported_generators.items():
            state = self.batch.requests.get(rid)
            if state is not None and state.generator is not None:
                state.generator.set_state(gen_state)
        self._imported_generators.clear()

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelOutput:
        if self.pooler is not None:
            for rid in so.finished_req_ids | so.preempted_req_ids:
                self.pooler.forget(rid)
        self.batch.update(so)
        if self._imported_generators:
            self._restore_generators()
        if so.is_empty:
            return ModelOutput()
        if self.draft is not None:
            so.scheduled_spec_tokens.update(self.draft.propose(so, self.batch))
        step = self.batch.prepare(so)
        masks = self._start_masks(step)
        logits, prompt_lps = self.forward(step)
        out = ModelOutput() if logits is None else self.sample(logits, step, masks)
        out.prompt_logprobs = prompt_lps
        out.pooled, self._pooled = self._pooled, {}
        if self._scored_attention is not None:  # KV eviction by score asked for this step's attention mass
            out.kv_block_scores = {step.req_ids[i]: s for i, s in self._scored_attention.block_scores().items()}
            self._scored_attention = None
        out.failed = {**self._failed(so), **out.failed}
        return out

    def _start_masks(self, step: StepInputs) -> tuple[list[int], Future] | None:
        """The sampling rows of constrained requests and a future of their bitmask (every matcher's state is
        known before the forward pass: its last token was consumed when sampled)."""
        rows = [i for i, s in enumerate(step.sampling) if s.matcher is not None and s.error is None]
        if not rows:
            return None
        matchers = [step.sampling[i].matcher for i in rows]
        return rows, self._mask_filler.submit(self.structured.fill_bitmask, matchers)

    def forward(self, step: StepInputs) -> tuple[torch.Tensor | None, dict[str, PromptLogprobs]]:
        """Run the model over every row of the step (writing its K/V). Returns the logits of the rows that
        sample, in ``step.sampling`` order (None when none does), and the logprobs of the prompt tokens this step
        scores for requests that asked (``prompt_logprobs``): those need rows that do not sample, so they are
        taken here, while every row's hidden state is at hand."""
        replayed = None if self.decode_graphs is None else self.decode_graphs.run(step, self.lora is not None)
        if replayed is not None:  # a decode-only step from its CUDA graph
            hidden = replayed
            self._scored_attention = None
        elif not self.info.causal:  # an encoder: the step's whole sequences packed, attention within each
            hidden = self.model(step.input_ids, step.positions, step.token_type_ids, step.attn_meta.query_start_loc)
        else:
            attn = make_attention(self.backend, step.attn_meta, self.dtype, step.padding, step.scored)
            self._scored_attention = attn if step.scored else None
            if self.lora is not None:
                self.lora.prepare(step, self.batch.requests)
            try:
                hidden = self.model(step.input_ids, step.positions, self.kv_caches, attn)
            finally:
                if self.lora is not None:
                    self.lora.done()
        if step.pool_rows:
            self._pooled = self.pooler.pool(hidden, step.pool_rows)
        prompt_lps = {rows.state.req_id: self._prompt_logprobs(hidden, rows) for rows in step.prompt_rows
                      if rows.state.error is None}
        if not step.sampling and not step.spec:
            return None, prompt_lps
        if step.logits_indices is not None:
            hidden = hidden.index_select(0, step.logits_indices)
        return self.model.compute_logits(hidden), prompt_lps

    def sample(self, logits: torch.Tensor, step: StepInputs,
               masks: tuple[list[int], Future] | None = None) -> ModelOutput:
        """One token per sampling row; each is appended to its request's own token list (and consumed by its
        matcher when constrained: ``masks`` are the constrained rows and their bitmask)."""
        out = ModelOutput()
        if step.spec:
            self._verify(logits[len(step.sampling):], step, out)
            logits = logits[:len(step.sampling)]
            if not step.sampling:
                return out
        constraint = None
        if masks is not None:
            rows, bitmask = masks[0], masks[1].result()
            for row, empty in zip(rows, (bitmask == 0).all(dim=1).tolist()):
                if empty:  # e.g. a JSON schema for a vocabulary without "{": nothing can be sampled
                    state = step.sampling[row]
                    state.error = "its grammar allows no token of this model's vocabulary here"
                    out.failed[state.req_id] = state.error
            constraint = (rows, bitmask)
        token_ids, logprobs = self.sampler.sample(logits, step.sampling_meta, constraint)
        for state, token, lp in zip(step.sampling, token_ids, logprobs):
            if state.error is not None:
                continue  # failed: the engine retires it after this step
            if state.matcher is not None and not state.matcher.consume_token(token):
                why = error_text(state.matcher.get_error())
                state.error = f"its grammar refused the sampled token {token}: {why}"
                out.failed[state.req_id] = state.error
                continue
            state.token_ids.append(token)
            out.sampled_token_ids[state.req_id] = token
            if lp is not None:
                out.logprobs[state.req_id] = lp
        return out

    def _verify(self, logits: torch.Tensor, step: StepInputs, out: ModelOutput) -> None:
        """Verify the proposals of ``step.spec`` (``logits``: their rows, in order; ``runner.spec_verify``) and
        append what each request produced to its tokens."""
        for spec, tokens in zip(step.spec, verify_proposals(self.sampler, logits, step.spec)):
            state = spec.state
            if state.error is not None:
                continue
            state.token_ids.extend(tokens)
            if self.draft is not None:
                self.draft.verified(state)
            out.sampled_token_ids[state.req_id] = tokens[0]
            if len(tokens) > 1:
                out.extra_token_ids[state.req_id] = tokens[1:]

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: PromptRows) -> PromptLogprobs:
        targets = rows.state.token_ids[rows.start:rows.start + rows.count]
        entries = []
        for i in range(0, rows.count, PROMPT_LOGITS_ROWS):
            n = min(PROMPT_LOGITS_ROWS, rows.count - i)
            logits = self.model.compute_logits(hidden[rows.row + i:rows.row + i + n])
            entries += prompt_logprobs(logits, targets[i:i + n], rows.state.params.prompt_logprobs)
        return PromptLogprobs(rows.start, entries)
