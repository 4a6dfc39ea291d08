"""Per-step attention metadata, built once by the runner and shared by every layer.

Token layout of one step (the runner orders requests so decodes come first, shortest context first):

    | decode reqs (1 token each) | prefill / chunk reqs (n tokens each) | pad tokens (baseline only) |
    0                     num_decodes                             num_tokens          num_tokens + num_pad

Request i owns query rows [query_start_loc[i], query_start_loc[i+1]); its queries sit at positions
num_computed[i] .. seq_lens[i]-1 and may see keys 0 .. their own position. Pad tokens form one fake
sequence that attends causally to itself only and writes nothing to the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int  # real (non-pad) tokens
    num_pad_tokens: int
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token's K/V
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]: context length after this step (computed + new)
    num_computed: list[int]  # [num_reqs]: tokens already in the cache before this step
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64, rows padded with 0
    num_decodes: int  # the first num_decodes requests have exactly one new token
    pad_segment: int = 0  # pad tokens form fake sequences of at most this many tokens (0: one sequence)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)
