"""ModelRunner: the torch executor. ``execute(SchedulerOutput) -> ModelOutput``, one forward pass per step."""

from __future__ import annotations

import torch

from conveyor.core.outputs import ModelOutput, PromptLogprobs, SchedulerOutput
from conveyor.layers.attention import make_attention, resolve_backend
from conveyor.models.loader import ModelInfo, resolve_dtype
from conveyor.runner.input_batch import InputBatch, PromptRows
from conveyor.runner.sampler import Sampler, prompt_logprobs

PROMPT_LOGITS_ROWS = 256  # prompt logprobs in slices: [256, 49152] float32 logits are 50 MB


class ModelRunner:
    """Owns the paged KV cache and the per-request state; runs the model and samples.

    The KV cache is one tensor per layer, [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]; block b
    covers cache slots [b * block_size, (b + 1) * block_size). Set ``return_logits = True`` to keep the logits
    of the last step in ``last_logits`` ({req_id: [vocab] float tensor}) for tests and debugging.
    """

    def __init__(self, model: torch.nn.Module, info: ModelInfo, num_blocks: int, block_size: int,
                 device: str | torch.device = "cpu", attention_backend: str = "auto",
                 num_threads: int | None = None, seed: int = 0, kv_dtype: str | torch.dtype | None = None) -> None:
        self.model, self.info = model, info
        self.device = torch.device(device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.backend = resolve_backend(attention_backend, self.device)
        if num_threads and self.device.type == "cpu":  # else keep the process's setting (the engine's choice)
            torch.set_num_threads(num_threads)
        self.dtype = resolve_dtype(kv_dtype or info.dtype)
        # Zeros, not empty: padded decode gathers read unwritten slots, and 0 * NaN garbage would poison them.
        self.kv_caches = [torch.zeros(2, num_blocks, block_size, info.num_kv_heads, info.head_dim,
                                      dtype=self.dtype, device=self.device) for _ in range(info.num_layers)]
        self.batch = InputBatch(block_size, self.device, max_position=info.max_position_embeddings)
        self.sampler = Sampler(info.eos_token_ids, self.device, seed)
        self.return_logits = False
        self.last_logits: dict[str, torch.Tensor] = {}

    @staticmethod
    def kv_cache_bytes_per_block(info: ModelInfo, block_size: int, dtype: str | torch.dtype | None = None) -> int:
        """Bytes one KV block takes over all layers (K and V), to size num_blocks from a memory budget."""
        element = torch.empty(0, dtype=resolve_dtype(dtype or info.dtype)).element_size()
        return 2 * info.num_layers * block_size * info.num_kv_heads * info.head_dim * element

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelOutput:
        self.batch.update(so)
        if so.is_empty:
            return ModelOutput()
        step = self.batch.prepare(so)
        attn = make_attention(self.backend, step.attn_meta, self.dtype)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, attn)
        out = ModelOutput()
        for rows in step.prompt_rows:
            out.prompt_logprobs[rows.state.req_id] = self._prompt_logprobs(hidden, rows)
        if not step.sampling:
            return out
        if step.logits_indices is not None:
            hidden = hidden.index_select(0, step.logits_indices)
        logits = self.model.compute_logits(hidden)
        if self.return_logits:
            self.last_logits = {r.req_id: logits[i].float().clone() for i, r in enumerate(step.sampling)}
        token_ids, logprobs = self.sampler.sample(logits, step.sampling)
        for state, token, lp in zip(step.sampling, token_ids, logprobs):
            state.token_ids.append(token)
            out.sampled_token_ids[state.req_id] = token
            if lp is not None:
                out.logprobs[state.req_id] = lp
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: PromptRows) -> PromptLogprobs:
        targets = rows.state.token_ids[rows.start:rows.start + rows.count]
        entries = []
        for i in range(0, rows.count, PROMPT_LOGITS_ROWS):
            n = min(PROMPT_LOGITS_ROWS, rows.count - i)
            logits = self.model.compute_logits(hidden[rows.row + i:rows.row + i + n])
            entries += prompt_logprobs(logits, targets[i:i + n], rows.state.params.prompt_logprobs)
        return PromptLogprobs(rows.start, entries)
