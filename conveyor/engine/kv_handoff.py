"""Disaggregated prefill / decode at the engine level: a request's prompt KV handed from one engine to another.

The prefill side (``LLMEngine.add_prefill_request``) runs a request until its first token is sampled, then
exports what the decode side needs to go on as if it had computed the prompt itself: the prompt's K/V (every
layer, ``runner.kv_io``'s per-token wire form), the token ids, the first token (and its logprobs), the sampling
params and the seeded generator's state. Its blocks are freed in the same step. A request that finishes at its
first token (EOS, a stop string, ``max_tokens=1``) needs no decode side and ends there as usual.

The decode side (``LLMEngine.add_handoff``) queues the request with ``num_computed_tokens`` = prompt length and
the first token in its output: the scheduler's hand-over path admits it as a one-token decode, allocating blocks
for every token; between that ``schedule`` and the step's ``execute`` the engine writes the K/V into those blocks
(``ModelRunner.import_kv``). A request aborted before it is admitted leaves nothing behind; a preempted one
recomputes its prompt here, as any preempted request does.

Nothing here needs Ray: ``KVHandoff`` is plain data (the K/V as a numpy byte array, which Ray's object store
and pickle carry without copies), and ``distributed.disagg`` moves it between replicas.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from conveyor.core.outputs import TokenLogprobs
from conveyor.core.sampling_params import SamplingParams


@dataclass
class KVHandoff:
    """Everything a decode engine needs to continue a request that a prefill engine started."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    sampling_params: SamplingParams
    kv_bytes: np.ndarray  # uint8, the wire-form tensor's bytes
    kv_shape: tuple[int, ...]  # [layers, 2, prompt tokens, kv heads, head dim]
    kv_dtype: str  # torch dtype name, e.g. "float32"
    generator_state: np.ndarray | None = None  # uint8: the seeded generator after the first draw
    num_cached_tokens: int = 0  # prompt tokens the prefill side's prefix cache served
    timings: dict[str, float] = field(default_factory=dict)  # monotonic s: arrival, first_token, exported

    @property
    def num_bytes(self) -> int:
        return int(self.kv_bytes.nbytes)

    @classmethod
    def pack(cls, kv: torch.Tensor, generator_state: torch.Tensor | None, **fields) -> KVHandoff:
        kv = kv.contiguous()
        raw = kv.view(torch.uint8)
        gen = generator_state.numpy().copy() if generator_state is not None else None
        return cls(kv_bytes=raw.reshape(-1).numpy(), kv_shape=tuple(kv.shape),
                   kv_dtype=str(kv.dtype).removeprefix("torch."), generator_state=gen, **fields)

    def kv(self) -> torch.Tensor:
        """The wire-form K/V tensor (a view of ``kv_bytes``, which may be read-only: it is only read)."""
        with warnings.catch_warnings():  # a read-only buffer out of Ray's object store: copied into the cache
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self.kv_bytes)
        return raw.view(getattr(torch, self.kv_dtype)).reshape(self.kv_shape)

    def generator(self) -> torch.Tensor | None:
        return None if self.generator_state is None else torch.from_numpy(self.generator_state.copy())


@dataclass
class HandoffBook:
    """An engine's requests in hand-over: prefill-only ones to export at their first token, and handed-over
    ones whose K/V waits for the step that admits them."""

    exporting: set[str] = field(default_factory=set)
    importing: dict[str, KVHandoff] = field(default_factory=dict)

    def drop(self, request_ids) -> None:
        """Aborted (or failed): forget them on both counts."""
        for rid in request_ids:
            self.exporting.discard(rid)
            self.importing.pop(rid, None)

    def __len__(self) -> int:
        return len(self.exporting) + len(self.importing)
