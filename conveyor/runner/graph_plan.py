"""Which steps may replay a captured CUDA graph, and at which padded batch size: the bookkeeping of decode-step
graphs, kept free of torch so any machine tests it.

A CUDA graph replays a fixed sequence of kernel launches over fixed buffers, so it can stand in for a step only
when the step has the shape it was captured at. Decode-only steps nearly do: one token per request, the same
kernels whatever the contexts (the paged attention kernel reads lengths and block tables from device buffers). So,
as nano-vllm and vLLM do, graphs are captured once per size of a ladder of batch sizes (``capture_sizes``), a step
of n decodes replays the smallest captured size >= n with its n rows first and the rest padding (slot -1: no KV
write; context 0: no keys read), and every other step runs eagerly: prompt chunks (the token count varies),
speculative verification (several rows per request), a baseline's pad rows, KV eviction's scored attention, LoRA
(rows grouped per adapter each step), pooling and prompt logprobs (which need every row's hidden state), and a
batch larger than the largest size. ``enforce_eager`` (vLLM's ``--enforce-eager``) replays nothing.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

# nano-vllm's ladder: small sizes one by one where padding would double the work, then steps of 16
_SMALL_SIZES = (1, 2, 4, 8)
_STEP = 16


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture, ascending: 1, 2, 4, 8, then multiples of 16, and ``max_num_seqs`` itself, so
    every decode-only step of up to ``max_num_seqs`` requests has a graph within 16 rows (or a factor 2 below 16)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in _SMALL_SIZES if s <= max_num_seqs}
    sizes.update(range(_STEP, max_num_seqs + 1, _STEP))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class StepShape:
    """What decides whether a step may replay (the runner fills it from its ``StepInputs``)."""

    num_reqs: int
    num_tokens: int  # real rows (a baseline's pad rows not included)
    num_padding_tokens: int = 0  # a static / dynamic batch's pad rows
    num_spec_rows: int = 0  # requests verifying proposed tokens
    scored: bool = False  # KV eviction asks for attention mass
    lora: bool = False  # some row runs with an adapter
    pooling: bool = False  # some request pools hidden states
    prompt_logprobs: bool = False  # some request scores its prompt


@dataclass(frozen=True)
class GraphChoice:
    """``size``: the captured batch size to replay (the step's ``num_reqs`` rows first, then ``padding`` rows);
    None: run eagerly, because of ``reason``."""

    size: int | None
    reason: str
    num_reqs: int

    @property
    def padding(self) -> int:
        return 0 if self.size is None else self.size - self.num_reqs


class DecodeGraphPlan:
    """The captured sizes and the replay decision for each step (module doc)."""

    def __init__(self, max_num_seqs: int, enforce_eager: bool = False) -> None:
        self.enforce_eager = enforce_eager
        self.sizes = () if enforce_eager else capture_sizes(max_num_seqs)

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size holding ``num_reqs`` rows; None when larger than every one."""
        i = bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def choose(self, step: StepShape) -> GraphChoice:
        """Replay (at which size) or run eagerly (why)."""
        def eager(reason: str) -> GraphChoice:
            return GraphChoice(None, reason, step.num_reqs)

        if self.enforce_eager:
            return eager("enforce_eager")
        if step.num_reqs == 0:
            return eager("empty step")
        if step.num_tokens != step.num_reqs or step.num_spec_rows:
            return eager("prompt chunks or speculative rows: not one token per request")
        for present, reason in ((step.num_padding_tokens, "a baseline's pad rows"),
                                (step.scored, "KV eviction's scored attention"), (step.lora, "LoRA rows"),
                                (step.pooling, "pooling"), (step.prompt_logprobs, "prompt logprobs")):
            if present:
                return eager(reason)
        size = self.padded_size(step.num_reqs)
        if size is None:
            return eager(f"{step.num_reqs} decodes: more than the largest captured size {self.sizes[-1]}")
        return GraphChoice(size, "decode-only", step.num_reqs)
