"""The static input buffers a captured decode-step CUDA graph reads, and how a step of n decodes fills them.

A CUDA graph replays kernels over the device addresses it was captured with, so every input of a decode step
lives in one buffer allocated once at the largest captured size (``graph_plan.capture_sizes``); a graph of size
B reads the first B rows. A step of n <= B decodes copies its rows in first and pads the rest so they compute
nothing that lands anywhere:

    row          0 .. n-1 (the step's decodes)        n .. B-1 (padding)
    input_ids    the last token                      0
    positions    its position                        0
    slot_mapping its KV slot                         -1   (the KV write skips it)
    seq_lens     its context + 1                     0    (attention reads no key; its output row is 0)
    query_start  0, 1, .., B: one query per row, written once and never changed
    block_table  its row of the table                left as it was (with seq_len 0, never read)

The attention backend reads ``query_start`` and ``seq_lens`` through ``AttentionMetadata.device_lens`` instead of
building them from the step's lists (a host-to-device copy a graph cannot replay).
"""

from __future__ import annotations

import torch

from conveyor.layers.attention import AttentionMetadata


class DecodeGraphInputs:
    """Buffers for up to ``max_size`` decodes whose tables hold up to ``max_blocks`` blocks (module doc)."""

    def __init__(self, max_size: int, max_blocks: int, block_size: int, device: torch.device | str) -> None:
        self.max_size, self.block_size = max_size, block_size
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_size, dtype=torch.int32, device=device)
        self.query_start = torch.arange(max_size + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_size, max_blocks, dtype=torch.int64, device=device)
        self.seq_lens_host: list[int] = []  # the last fill's rows, as the lists of its metadata
        self.num_computed_host: list[int] = []

    def fill(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy a decode-only step (``meta.num_reqs`` rows, one token each) into the first rows and pad up to
        ``size``, the captured size it replays (``graph_plan.DecodeGraphPlan.choose``)."""
        n = meta.num_reqs
        if meta.num_tokens != n or meta.num_decodes != n:
            raise ValueError(f"a decode graph takes one token per request, got {meta.num_tokens} tokens for {n}")
        if not n <= size <= self.max_size:
            raise ValueError(f"{n} decodes do not fit a graph of size {size} (buffers hold {self.max_size})")
        width = meta.block_table.shape[1]
        if width > self.block_table.shape[1]:
            raise ValueError(f"a block table of {width} blocks is wider than the buffers' "
                             f"{self.block_table.shape[1]}")
        self.input_ids[:n].copy_(input_ids[:n], non_blocking=True)
        self.positions[:n].copy_(positions[:n], non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(torch.tensor(meta.seq_lens, dtype=torch.int32), non_blocking=True)
        self.block_table[:n, :width].copy_(meta.block_table, non_blocking=True)
        # Rows the previous step filled and this one pads: back to padding (input ids and positions may stay: a
        # padded row's output is never read, and it writes no KV and reads none)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(0)
        self.seq_lens_host, self.num_computed_host = list(meta.seq_lens), list(meta.num_computed)

    def pad_all(self, size: int) -> None:
        """Every one of the first ``size`` rows padding (what a graph is captured over: it writes and reads no KV)."""
        self.slot_mapping[:size].fill_(-1)
        self.seq_lens[:size].fill_(0)
        self.seq_lens_host, self.num_computed_host = [], []

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata of a graph of ``size`` rows over these buffers, for the backends that read
        ``device_lens`` (triton): the last ``fill``'s rows, then padding rows (one query, no key: only a
        device-lens backend computes those, as zeros)."""
        pad = size - len(self.seq_lens_host)
        return AttentionMetadata(
            num_tokens=size, block_size=self.block_size, slot_mapping=self.slot_mapping[:size],
            query_start_loc=list(range(size + 1)), seq_lens=self.seq_lens_host + [0] * pad,
            num_computed=self.num_computed_host + [0] * pad, block_table=self.block_table[:size], num_decodes=size,
            device_lens=(self.query_start[:size + 1], self.seq_lens[:size]))
