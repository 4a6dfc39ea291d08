"""Decode-only steps through captured CUDA graphs (``--cuda-graphs``): the model's forward pass captured once per
batch size of ``graph_plan.capture_sizes`` over the static buffers of ``decode_graph_inputs``, and replayed for
every step the plan lets replay; every other step runs eagerly, as before.

What this saves is the host: a decode step of a 1.1B model launches ~90 kernels per layer one by one from Python
(docs/benchmarks.md, "The CUDA path"); a replay is one launch. Only an attention backend whose class is
``graph_capturable`` (it launches the same kernels over the same addresses at every call: ``triton``) can be
captured. Off by default: no GPU has run it yet (docs/gpu.md); ``capture=False`` runs the same forward over the
same padded buffers without a graph, which is how the CPU tests check everything here but the capture itself.
"""

from __future__ import annotations

from typing import Callable

import torch

from conveyor.layers.attention import AttentionMetadata
from conveyor.runner.decode_graph_inputs import DecodeGraphInputs
from conveyor.runner.graph_plan import DecodeGraphPlan, StepShape
from conveyor.runner.input_batch import StepInputs

# (input_ids [B], positions [B], the step's attention metadata) -> hidden states [B, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """The captured graphs (size -> graph, its static output) and the step-by-step choice to replay one."""

    def __init__(self, forward: Forward, max_num_seqs: int, max_blocks: int, block_size: int,
                 device: torch.device, capture: bool = True) -> None:
        self.forward = forward
        self.plan = DecodeGraphPlan(max_num_seqs)
        self.buffers = DecodeGraphInputs(self.plan.sizes[-1], max_blocks, block_size, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0  # decode steps served from the buffers (by a graph, or eagerly without capture)
        if capture:
            self._capture_all()

    def _run_buffers(self, size: int) -> torch.Tensor:
        buffers = self.buffers
        return self.forward(buffers.input_ids[:size], buffers.positions[:size], buffers.metadata(size))

    @torch.inference_mode()  # as every step runs (ModelRunner.execute): no autograd record in the graph
    def _capture_all(self) -> None:
        """Largest size first, all sharing one memory pool (as vLLM and nano-vllm capture). Each size runs once
        before its capture: Triton compiles its kernels then, outside the graph."""
        pool = None
        for size in reversed(self.plan.sizes):
            self.buffers.pad_all(size)  # every row padding: the warm-up and the capture write no KV
            self._run_buffers(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._run_buffers(size)
            pool = graph.pool()
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()

    def run(self, step: StepInputs, lora: bool) -> torch.Tensor | None:
        """The step's hidden states [num_reqs, hidden] from a replay, or None when it must run eagerly (the plan
        says why; ``lora``: some adapter is attached). The tensor is the graph's: read it before the next step."""
        meta = step.attn_meta
        shape = StepShape(num_reqs=meta.num_reqs, num_tokens=meta.num_tokens,
                          num_padding_tokens=step.padding.num_tokens if step.padding is not None else 0,
                          num_spec_rows=len(step.spec), scored=bool(step.scored), lora=lora,
                          pooling=bool(step.pool_rows), prompt_logprobs=bool(step.prompt_rows))
        choice = self.plan.choose(shape)
        if choice.size is None or meta.block_table.shape[1] > self.buffers.block_table.shape[1]:
            return None
        self.buffers.fill(choice.size, step.input_ids, step.positions, meta)
        if choice.size in self.graphs:
            graph, hidden = self.graphs[choice.size]
            graph.replay()
        else:  # not captured (the CPU tests): the same forward over the same buffers
            hidden = self._run_buffers(choice.size)
        self.num_replays += 1
        return hidden[:choice.num_reqs]
