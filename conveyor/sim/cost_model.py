"""Cost models: how long one forward pass takes, and the FLOPs and bytes it needs. PURE PYTHON.

One interface: ``step_cost(shape) -> StepCost`` (``step_time(shape)`` is its seconds). A ``StepShape`` is a
``SchedulerOutput`` as a cost model sees it: per scheduled request its query tokens and the tokens already in
its cache, how many rows sample, and the static baselines' pad tokens (``StepShape.of`` builds it from a
``SchedulerOutput`` and the executor-side token counts that say who samples; see ``executor.py``).

The roofline (``RooflineCostModel``) prices four ops; each takes max(FLOPs / achieved FLOP rate, bytes /
achieved bandwidth), and the step takes their sum plus overheads::

    op          FLOPs                                       bytes read
    linears     2 x linear params x tokens                  linear weights (once per step; a mixture of
                (a mixture: the experts a token runs)         experts: the experts its tokens choose, each once)
    attention   4 x q_dim x layers x keys attended          K and V of each request's whole context, per layer
                (prefill rows and decode rows priced apart)
    lm_head     2 x hidden x vocab x sampled rows           lm_head weights (when any row samples)
    all-reduce  (tensor parallel) 2 per layer of tokens x hidden, ring: 2 (tp - 1) / tp of it over the link

    time = sum of the ops + step_overhead + per_request_overhead x requests + per_token_overhead x tokens

With tensor parallelism every device holds 1/tp of the weights and query heads and max(1, kv_heads / tp) KV
heads; FLOPs and bytes in a ``StepCost`` are totals over all devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from conveyor.sim.hardware import Hardware
from conveyor.sim.model_specs import ModelSpec

INT8_KV_SCALE_BYTES = 4  # an int8 KV row's float32 scale (layers/attention/kv_quant.py)


@dataclass(slots=True)
class StepShape:
    """One forward pass as data: ``rows[i] = (query_tokens, tokens_computed_before)`` per scheduled request."""

    rows: list[tuple[int, int]] = field(default_factory=list)
    num_sampled: int = 0
    num_padding_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(q for q, _ in self.rows) + self.num_padding_tokens

    @property
    def num_reqs(self) -> int:
        return len(self.rows)

    def to_list(self) -> list:
        """Compact JSON form (calibration profiles store the shapes they were fitted on)."""
        return [[list(r) for r in self.rows], self.num_sampled, self.num_padding_tokens]

    @classmethod
    def from_list(cls, data: list) -> StepShape:
        rows, sampled, pad = data
        return cls([(int(q), int(c)) for q, c in rows], int(sampled), int(pad))


@dataclass(slots=True)
class StepCost:
    """What one step costs: seconds, and the FLOPs / bytes it needs in total over all devices."""

    seconds: float
    flops: float = 0.0
    bytes: float = 0.0


class CostModel(Protocol):
    """The one interface every cost model implements."""

    def step_cost(self, shape: StepShape) -> StepCost: ...

    def step_time(self, shape: StepShape) -> float: ...


class ConstantCostModel:
    """Every step takes ``seconds``, whatever it computes (the schedule-equivalence test uses it)."""

    def __init__(self, seconds: float = 0.01) -> None:
        if seconds <= 0:
            raise ValueError(f"a step must take a positive time, got {seconds}")
        self.seconds = seconds

    def step_cost(self, shape: StepShape) -> StepCost:
        return StepCost(self.seconds)

    def step_time(self, shape: StepShape) -> float:
        return self.seconds

    def describe(self) -> str:
        return f"constant {self.seconds * 1e3:g} ms per step"


@dataclass(slots=True)
class OpCost:
    """One op's FLOPs and bytes in a step, on one device."""

    flops: float = 0.0
    bytes: float = 0.0

    def seconds(self, flop_rate: float, bandwidth: float) -> float:
        """The roofline: compute or memory, whichever is slower."""
        return max(self.flops / flop_rate, self.bytes / bandwidth)


@dataclass(slots=True)
class OpCounts:
    """FLOPs and bytes of one step per op, for one device (before overheads)."""

    linear: OpCost = field(default_factory=OpCost)
    prefill_attn: OpCost = field(default_factory=OpCost)
    decode_attn: OpCost = field(default_factory=OpCost)
    lm_head: OpCost = field(default_factory=OpCost)
    allreduce_bytes: float = 0.0  # payload of each all-reduce
    num_allreduces: int = 0

    @property
    def flops(self) -> float:
        return self.linear.flops + self.prefill_attn.flops + self.decode_attn.flops + self.lm_head.flops

    @property
    def bytes(self) -> float:
        return self.linear.bytes + self.prefill_attn.bytes + self.decode_attn.bytes + self.lm_head.bytes


def causal_pairs(query: int, computed: int) -> int:
    """Query-key pairs of ``query`` new tokens after ``computed`` cached ones: token i sees computed + i + 1 keys."""
    return query * computed + query * (query + 1) // 2


class RooflineCostModel:
    """Roofline per op on ``hardware`` for ``model``, with ``tp``-way tensor parallelism (see the module doc)."""

    def __init__(self, model: ModelSpec, hardware: Hardware, tensor_parallel_size: int = 1,
                 dtype_bytes: int | None = None, kv_cache_dtype: str = "auto") -> None:
        """``kv_cache_dtype``: "auto" (K/V in the weights' ``dtype_bytes``), "bfloat16" (2 bytes a value) or "int8"
        (a byte per value plus a float32 scale per token and head: conveyor's ``--kv-cache-dtype int8``)."""
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if tensor_parallel_size > 1 and hardware.link_bandwidth <= 0:
            raise ValueError(f"{hardware.name} has no device-to-device link: tensor parallelism is not modelled")
        self.model, self.hw, self.tp = model, hardware, tensor_parallel_size
        self.dtype_bytes = dtype_bytes or hardware.dtype_bytes
        hw, b = hardware, self.dtype_bytes
        self.matmul_rate = hw.peak_flops * hw.matmul_efficiency
        self.attention_rate = hw.peak_flops * hw.attention_efficiency
        self.bandwidth = hw.mem_bandwidth * hw.memory_efficiency
        tp = tensor_parallel_size
        # Per device: a 1/tp slice of every weight matrix and query head; KV heads are replicated when tp > kv heads.
        self.kv_heads_per_device = max(1, -(-model.num_kv_heads // tp))
        self.kv_cache_dtype = kv_cache_dtype
        value_bytes = {"int8": 1, "bfloat16": 2}.get(kv_cache_dtype, b)
        row = model.head_dim * value_bytes + (INT8_KV_SCALE_BYTES if kv_cache_dtype == "int8" else 0)
        self.kv_bytes_per_token_per_device = 2 * model.num_layers * self.kv_heads_per_device * row
        self.attn_flops_per_pair = 4.0 * model.num_layers * model.q_dim / tp
        self.linear_flops_per_token = 2.0 * model.per_token_linear_params / tp
        self.weight_bytes_per_param = b / tp
        self.lm_head_flops_per_row = 2.0 * model.lm_head_params / tp
        self.lm_head_bytes = model.lm_head_params * b / tp

    def describe(self) -> str:
        kv = f"{self.kv_cache_dtype} KV" if self.kv_cache_dtype != "auto" else "KV"
        return (f"roofline: {self.model.name} on {self.tp} x {self.hw.name}, {self.dtype_bytes}-byte weights/{kv} "
                f"({self.hw.source})")

    def weight_bytes(self) -> float:
        """Bytes of weights on one device (for memory checks)."""
        return self.model.num_params * self.dtype_bytes / self.tp

    def kv_bytes_per_token(self) -> float:
        """Bytes one cached token takes over all devices."""
        return self.kv_bytes_per_token_per_device * self.tp

    def op_counts(self, shape: StepShape) -> OpCounts:
        """FLOPs and bytes of each op on one device."""
        ops = OpCounts()
        tokens = prefill_pairs = prefill_ctx = decode_ctx = 0
        longest = 0
        for q, computed in shape.rows:
            tokens += q
            if q == 1:
                decode_ctx += computed + 1
            else:
                prefill_pairs += causal_pairs(q, computed)
                prefill_ctx += computed + q
                longest = max(longest, q)
        pad = shape.num_padding_tokens
        if pad:  # pad rows: causal self-attention within segments as long as the longest chunk (the runner's way)
            segment = max(longest, 1)
            full, rest = divmod(pad, segment)
            prefill_pairs += full * causal_pairs(segment, 0) + causal_pairs(rest, 0)
            prefill_ctx += pad
            tokens += pad
        if tokens == 0:
            return ops
        ops.linear = OpCost(self.linear_flops_per_token * tokens,
                            self.model.step_linear_params(tokens) * self.weight_bytes_per_param)
        ops.prefill_attn = OpCost(self.attn_flops_per_pair * prefill_pairs,
                                  self.kv_bytes_per_token_per_device * prefill_ctx)
        ops.decode_attn = OpCost(self.attn_flops_per_pair * decode_ctx, self.kv_bytes_per_token_per_device * decode_ctx)
        if shape.num_sampled:
            ops.lm_head = OpCost(self.lm_head_flops_per_row * shape.num_sampled, self.lm_head_bytes)
        if self.tp > 1:
            ops.num_allreduces = 2 * self.model.num_layers  # after o_proj and after down_proj
            ops.allreduce_bytes = tokens * self.model.hidden_size * self.dtype_bytes
        return ops

    def op_seconds(self, ops: OpCounts) -> float:
        """Compute or memory, whichever is slower, per op; plus the all-reduces."""
        bw = self.bandwidth
        t = ops.linear.seconds(self.matmul_rate, bw)
        t += ops.prefill_attn.seconds(self.attention_rate, bw)
        t += ops.decode_attn.seconds(self.attention_rate, bw)
        t += ops.lm_head.seconds(self.matmul_rate, bw)
        if ops.num_allreduces:
            hw = self.hw
            ring = 2.0 * (self.tp - 1) / self.tp * ops.allreduce_bytes / (hw.link_bandwidth * hw.link_efficiency)
            t += ops.num_allreduces * (hw.allreduce_latency_s + ring)
        return t

    def overhead_seconds(self, shape: StepShape) -> float:
        hw = self.hw
        return hw.step_overhead_s + hw.per_request_overhead_s * len(shape.rows) + hw.per_token_overhead_s * (
            shape.num_tokens)

    def step_cost(self, shape: StepShape) -> StepCost:
        ops = self.op_counts(shape)
        seconds = self.op_seconds(ops) + self.overhead_seconds(shape)
        return StepCost(seconds, ops.flops * self.tp, ops.bytes * self.tp)

    def step_time(self, shape: StepShape) -> float:
        return self.step_cost(shape).seconds
