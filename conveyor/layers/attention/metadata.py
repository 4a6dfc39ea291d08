"""Per-step attention metadata, built once by the runner and shared by every layer.

Token layout of one step (the runner orders requests so decodes come first, shortest context first):

    | decode reqs (1 token each) | prefill / chunk reqs (n tokens each) |
    0                     num_decodes                             num_tokens

Request i owns query rows [query_start_loc[i], query_start_loc[i+1]); its queries sit at KV slots
num_computed[i] .. seq_lens[i]-1 and may see keys 0 .. their own slot. Counts here are KV slots, not positions:
they are the same unless a KV eviction policy dropped blocks from the middle of a request's table
(``core.kv_eviction``), and then RoPE still takes the original positions (the step's ``positions`` tensor), so
attention only sees fewer keys. (A baseline's pad rows, when a step
has any, come after ``num_tokens`` and are handled by ``padded.PaddedAttention``: backends never see them.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token's K/V
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]: KV slots after this step (cached + new): the keys attention sees
    num_computed: list[int]  # [num_reqs]: KV slots already in the cache before this step
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64, rows padded with 0
    num_decodes: int  # the first num_decodes requests have exactly one new token
    # Some request's KV slots are not its positions (KV eviction dropped blocks): a backend that derives a token's
    # RoPE angle from its KV slot must not rotate this step (``make_attention`` sees to it)
    slots_shifted: bool = False
    # With slots_shifted: each request's position minus its KV slot (the tokens eviction dropped from it)
    rope_offsets: list[int] | None = None
    # The int32 query starts [num_reqs + 1] and seq_lens [num_reqs] already on the device, for a backend whose kernels
    # read them there (triton): a captured decode graph's static buffers (runner.decode_graph_inputs), whose
    # addresses the graph replays. None: the backend builds them from the lists.
    device_lens: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)
