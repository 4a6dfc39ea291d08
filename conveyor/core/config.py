"""Scheduler and KV cache settings, named as vLLM names them where a name exists."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.core.kv_eviction import H2O_SCORE_PERIOD, EvictionConfig
from conveyor.core.prefix_eviction import PREFIX_EVICTION_POLICIES
from conveyor.core.speculative import SpeculativeConfig

KV_LAYOUTS = ("paged", "slab")
# --kv-cache-dtype: "auto" keeps K/V in the model's dtype; "int8" stores each token's head as 8-bit integers with a
# float32 scale (layers/attention/kv_quant.py), read by the native CPU attention kernels.
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")
# vLLM's 8-bit float names: conveyor stores no fp8 format, so they are refused by name rather than run as int8.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
# --attention-backend: "auto" and "cpu" choose for the machine (layers.attention.resolve_backend); the rest name
# one backend each. Here, not in the torch package, so the flag's choices are known without importing torch.
ATTENTION_BACKENDS = ("auto", "cpu", "cpu-native", "cpu-torch", "reference", "cuda", "triton")
# --quantization: what becomes of a GGUF file's blocks or a float checkpoint's weights at load (models.quantize)
# ("int8" and "w8a8": the same per-channel int8 weights; int8 runs 15-bit activations per block, w8a8 8-bit ones per
# token, as vLLM's W8A8)
QUANTIZATION_CHOICES = ("auto", "none", "int8", "w8a8")
# When a step schedules nothing while requests wait and none runs, only time or a new request can change that
# (a dynamic batch forming until max_wait_ms; the engine's requests waiting for a grammar): a driver asks again
# after this long. One period for every driver (the engine's step loop, the in-process replay, the simulator),
# so the simulator schedules a trace as the real engine does.
IDLE_POLL_S = 0.001
# --scheduling-policy: the order requests are served in (core.policies.priority); priority needs a policy that
# re-decides every step, so the baselines serve first come, first served.
SCHEDULING_POLICIES = ("fcfs", "priority")
PRIORITY_POLICIES = ("continuous", "chunked")
# Policies a request may speculate or evict KV under: the baselines park finished requests in fixed slots and pad
# batches.
SPECULATING_POLICIES = ("continuous", "chunked")


def resolve_scheduling_policy(policy: str, scheduling_policy: str | None) -> str:
    """The scheduling policy a ``SchedulerConfig`` of ``policy`` runs (None: its default)."""
    if scheduling_policy is None:
        return "priority" if policy in PRIORITY_POLICIES else "fcfs"
    return scheduling_policy


@dataclass
class SchedulerConfig:
    """Knobs of the scheduler and of the policy objects it holds. ``max_model_len`` is filled in by the engine from
    the model when left None.

    ``policy`` names one of ``policies.POLICIES``; the registry checks the name when it builds the policy.
    ``speculative_config`` (the ``Speculator``'s) and ``eviction`` (the ``KVEvictor``'s) turn those on."""

    policy: str = "chunked"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    long_prefill_token_threshold: int = 0  # 0: a single prompt chunk may take the whole budget
    max_wait_ms: float = 0.0  # dynamic batching: how long the oldest waiting request may wait for a full batch
    # speculative decoding (None: off); a dict or JSON string is parsed (vLLM's --speculative-config)
    speculative_config: SpeculativeConfig | None = None
    eviction: EvictionConfig | None = None  # KV eviction (None, or policy "none": off); CacheConfig's flags make it
    # The model attends both ways (an encoder): a prompt cannot be computed in chunks, each runs whole in one step
    whole_prompts: bool = False
    # "fcfs" or "priority" (each request's ``priority``, lower first); None: priority for continuous and chunked
    # batching (with every priority equal it serves in arrival order), fcfs for the baselines
    scheduling_policy: str | None = None
    # priority: while requests of several priorities run, the tokens of those below the best may add at most this
    # fraction to the step's time (from the measured step cost); None: they take whatever budget is left
    priority_step_slack: float | None = None
    # priority: a step holding only requests that a new arrival outranks is cut short between layers (dropped and
    # redone later) if less than this fraction of its layers ran (policies.step_cut); 0: never cut
    priority_step_cut: float = 1.0
    # LoRA: at most this many distinct adapters among the running requests (the runner's adapter slots); a waiting
    # request of another adapter waits at the queue head until one of them has no running request. 0: no bound.
    max_loras: int = 0

    @property
    def uses_step_cost(self) -> bool:
        """Whether the policy's decisions read the measured step cost (``policies.base.Room.step_cost``)."""
        return self.priority_step_slack is not None

    def __post_init__(self) -> None:
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.whole_prompts and self.max_model_len is not None and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must hold a whole prompt of "
                             f"max_model_len ({self.max_model_len}): this model's prompts are not chunked")
        self.scheduling_policy = resolve_scheduling_policy(self.policy, self.scheduling_policy)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}")
        if self.scheduling_policy == "priority" and self.policy not in PRIORITY_POLICIES:
            raise ValueError(f"scheduling_policy priority runs with the {' or '.join(PRIORITY_POLICIES)} policy, not "
                             f"{self.policy!r} (a static batch is not re-decided when a request of higher priority "
                             "arrives)")
        if self.priority_step_slack is not None and not self.priority_step_slack >= 0:
            raise ValueError(f"priority_step_slack must be >= 0, got {self.priority_step_slack}")
        if not 0.0 <= self.priority_step_cut <= 1.0:
            raise ValueError(f"priority_step_cut must be in [0, 1], got {self.priority_step_cut}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and self.policy not in SPECULATING_POLICIES:
            raise ValueError(f"speculative decoding runs with the {' or '.join(SPECULATING_POLICIES)} policy, "
                             f"not {self.policy!r}")
        if self.eviction is not None and not self.eviction.enabled:
            self.eviction = None
        if self.eviction is not None and self.speculative_config is not None:
            raise ValueError("KV eviction and speculative decoding do not run together yet (a rejected proposal's "
                             "slots are given back by position, which eviction shifts)")
        if self.eviction is not None and self.policy not in SPECULATING_POLICIES:
            raise ValueError(f"KV eviction runs with the continuous or chunked policy, not {self.policy!r} "
                             f"(the baselines pad batches and park finished requests in fixed slots)")


@dataclass
class CacheConfig:
    """KV cache shape: ``num_kv_blocks`` blocks of ``block_size`` tokens in the given layout."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory by the engine
    kv_cache_memory: float = 1.0  # GiB, used when num_kv_blocks is None
    enable_prefix_caching: bool = True
    kv_layout: str = "paged"
    prefix_cache_eviction: str = "lru"  # which cached free block goes first: core.prefix_eviction
    kv_eviction: str = "none"  # which blocks a request over its KV budget gives back: core.kv_eviction
    kv_budget_tokens: int | None = None  # the default per-request budget of kv_eviction
    kv_score_period: int = H2O_SCORE_PERIOD  # h2o: a decode's attention is scored every this many steps
    kv_h2o_rank: str = "mean"  # h2o: rank blocks by mass per query that saw them, or accumulated (sum)
    # A model whose every layer has a sliding window: give back the blocks outside every window as requests
    # advance (core.sliding_window). Off: hold each request's whole history, as full attention does.
    free_outside_window: bool = True
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES: the model's dtype, bfloat16, or int8 rows with their scales

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if self.prefix_cache_eviction not in PREFIX_EVICTION_POLICIES:
            raise ValueError(f"prefix_cache_eviction must be one of {', '.join(PREFIX_EVICTION_POLICIES)}, "
                             f"got {self.prefix_cache_eviction!r}")
        eviction = self.eviction_config()  # checks the policy name and the budget
        if eviction.enabled and self.kv_layout != "paged":
            raise ValueError(f"kv_eviction {self.kv_eviction!r} needs the paged KV layout (it gives blocks back to "
                             f"the pool); the {self.kv_layout} layout reserves a whole slab per request")

    def eviction_config(self) -> EvictionConfig:
        """The KV eviction settings (``core.kv_eviction``)."""
        return EvictionConfig(self.kv_eviction, self.kv_budget_tokens, score_period=self.kv_score_period,
                              h2o_rank=self.kv_h2o_rank)


def check_kv_cache_dtype(name: str) -> None:
    """Refuse a ``kv_cache_dtype`` conveyor does not store, vLLM's fp8 names by what they would have meant."""
    if name in FP8_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r}: conveyor does not store K/V as 8-bit floats; 'int8' stores them "
                         "in 8 bits too (an integer per value and a float32 scale per token and head), read by the "
                         "native CPU attention kernels")
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
