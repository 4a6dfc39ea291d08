"""``EngineArgs``: every knob of an engine in one flat dataclass (the CLI, ``LLM`` and the server share it).

The command-line flags are generated from the fields (``--max-num-seqs`` from ``max_num_seqs``), and the
scheduler and cache knobs take their defaults from ``SchedulerConfig`` / ``CacheConfig``: each default is
written once.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, dataclass, field, fields

from conveyor.core.config import (
    ATTENTION_BACKENDS, KV_LAYOUTS, QUANTIZATION_CHOICES, SCHEDULING_POLICIES, CacheConfig, SchedulerConfig,
)
from conveyor.core.kv_eviction import H2O_RANKS, KV_EVICTION_POLICIES
from conveyor.core.policies import POLICIES
from conveyor.core.prefix_eviction import PREFIX_EVICTION_POLICIES
from conveyor.engine.cpu_priority import CPU_PRIORITIES
from conveyor.models.pooling_config import CONVERT_CHOICES

DTYPE_CHOICES = ("float32", "bfloat16", "float16", "auto")


def _arg(default, help: str, **argparse_options):
    """A field with its command-line help (and argparse options such as ``choices``) in its metadata."""
    return field(default=default, metadata={"help": help, **argparse_options})


@dataclass
class EngineArgs:
    """Engine settings, named as vLLM names them. ``model``: a model name, a GGUF file (or a directory holding
    one) or a Hugging Face directory; None is the default model, SmolLM2-135M-Instruct (``models/sources.py``)."""

    model: str | None = _arg(None, "a model name (SmolLM2-135M-Instruct, the default; "
                                   "conveyor-embedded-llama-40m-random, random weights, the benchmarks' default), "
                                   "a GGUF file or a directory holding one, or a Hugging Face model directory")
    dtype: str = _arg("auto", "weights and KV cache dtype; auto: bfloat16 on CPUs that multiply it in hardware "
                              "(AVX512_BF16 / AMX), else float32", choices=DTYPE_CHOICES)
    quantization: str = _arg("auto", "auto: a GGUF file's weights stay in their blocks and run on the integer "
                                     "kernels (CPU); none: dequantize them into --dtype; int8: quantize a float "
                                     "checkpoint's linear layers to per-channel int8 at load (activations 15-bit per "
                                     "block); w8a8: the same int8 weights against 8-bit activations per token, as "
                                     "vLLM's W8A8",
                             choices=QUANTIZATION_CHOICES)
    device: str = _arg("auto", '"auto" (CUDA when available, else CPU), "cpu", "cuda", ...')
    seed: int = _arg(0, "seed of unseeded sampling and of the embedded model's random weights")
    policy: str = _arg(SchedulerConfig.policy, "batching policy", choices=tuple(POLICIES))
    scheduling_policy: str | None = _arg(SchedulerConfig.scheduling_policy, "the order requests are served in: "
                                         "priority (each request's priority, lower first, ties by arrival; the "
                                         "default for continuous and chunked batching) or fcfs (arrival order; "
                                         "the baselines' only order)", choices=SCHEDULING_POLICIES)
    priority_step_slack: float | None = _arg(
        SchedulerConfig.priority_step_slack, "priority scheduling: while requests of several priorities run, the "
        "tokens of those below the best may add at most this fraction to a step's measured time (e.g. 0.15: a batch "
        "job slows interactive decodes by at most 15%%); default: they fill the step's token budget")
    priority_step_cut: float = _arg(
        SchedulerConfig.priority_step_cut, "priority scheduling: a step of only lower-priority requests (a Batch API "
        "job's) is cut short between layers when a request of better priority arrives, if less than this fraction "
        "of its layers ran; its work is dropped and redone later (docs/scheduling.md). 0: never cut")
    max_num_seqs: int = _arg(SchedulerConfig.max_num_seqs, "most requests in the running batch")
    cuda_graphs: bool = _arg(False, "decode-only steps replay CUDA graphs captured at start (a CUDA device and the "
                                    "triton attention backend; not yet run on a GPU, so off by default: docs/gpu.md)")
    max_num_batched_tokens: int = _arg(SchedulerConfig.max_num_batched_tokens,
                                       "token budget of one step (chunked prefill)")
    max_model_len: int | None = _arg(SchedulerConfig.max_model_len, "context length (default: the model's)")
    long_prefill_token_threshold: int = _arg(SchedulerConfig.long_prefill_token_threshold,
                                             "most tokens of one prompt per step (0: no cap)")
    max_wait_ms: float = _arg(SchedulerConfig.max_wait_ms, "dynamic batching: how long the oldest request may "
                                                           "wait for a full batch")
    speculative_config: str | None = _arg(
        None, 'speculative decoding as a JSON object (vLLM\'s keys), e.g. \'{"method": "ngram", '
              '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'; conveyor\'s '
              '"adaptive" (default true) picks each step\'s lengths from the load, up to num_speculative_tokens; '
              '"model": PATH proposes with a draft model instead (method draft_model). '
              'LLM(speculative_config=...) also takes a dict. Default: off')
    block_size: int = _arg(CacheConfig.block_size, "tokens per KV cache block")
    num_kv_blocks: int | None = _arg(CacheConfig.num_kv_blocks, "KV cache size in blocks (default: from "
                                                                "--kv-cache-memory)")
    kv_cache_memory: float = _arg(CacheConfig.kv_cache_memory, "KV cache size in GiB")
    enable_prefix_caching: bool = _arg(CacheConfig.enable_prefix_caching, "reuse the KV of shared prompt prefixes")
    kv_layout: str = _arg(CacheConfig.kv_layout, "KV cache layout", choices=KV_LAYOUTS)
    kv_cache_dtype: str = _arg(CacheConfig.kv_cache_dtype, "KV cache element type: auto (the model's dtype), "
                               "bfloat16 (a float32 model's K/V rounded to 16 bits: half the bytes, the arithmetic "
                               "still float32) or int8 (8-bit values with a float32 scale per token and head: about half a bfloat16 "
                               "cache's bytes, a quarter of float32's; native CPU attention only; vLLM's fp8 names "
                               "are refused: docs/kv-cache.md)")
    prefix_cache_eviction: str = _arg(CacheConfig.prefix_cache_eviction, "which cached prefix block a full KV "
                                      "cache gives up first: lru (least recently freed) or cost (GDSF: hits x "
                                      "recompute cost, aged; leaves of a chain first)",
                                      choices=PREFIX_EVICTION_POLICIES)
    kv_eviction: str = _arg(CacheConfig.kv_eviction, "KV eviction policy for requests over their KV budget: none "
                            "(exact, the default), sink (first tokens + a recent window), h2o (accumulated "
                            "attention + recent), snapkv (compress the prompt once after prefill); paged layout "
                            "only (docs/kv-eviction.md)", choices=KV_EVICTION_POLICIES)
    kv_budget_tokens: int | None = _arg(CacheConfig.kv_budget_tokens, "default KV budget per request in tokens "
                                        "under --kv-eviction (a request's kv_budget_tokens overrides it; "
                                        "default: only requests that set one are evicted from)")
    kv_score_period: int = _arg(CacheConfig.kv_score_period, "h2o: score a decode's attention every N of its "
                                "steps (1: every step, as the paper; prompt chunks are always scored)")
    kv_h2o_rank: str = _arg(CacheConfig.kv_h2o_rank, "h2o: rank old blocks by their attention mass per query "
                            "that saw them (mean) or by accumulated mass as the paper (sum)", choices=H2O_RANKS)
    free_outside_window: bool = _arg(CacheConfig.free_outside_window, "on a model whose every layer has a "
                                     "sliding window, give a request's blocks outside the window back to the pool "
                                     "as it advances (--no-free-outside-window: hold its whole history)")
    convert: str = _arg("auto", "what the model serves: auto (from its checkpoint: an encoder, an architecture "
                                "without an LM head or sentence-transformers' files embed, a classifier scores), "
                                "none (generate), embed, classify (score pairs)", choices=CONVERT_CHOICES)
    pooler_config: str | None = _arg(
        None, 'a pooling model\'s settings as a JSON object (vLLM\'s): "pooling_type" (mean, cls, last), "normalize", '
              '"dimensions" (default embedding length), "matryoshka_dimensions" (lengths a request may ask for, or '
              'true: any), "classifier_from_token" (a decoder reranker\'s ["no", "yes"]), "score_template" '
              '(its prompt, with {query}, {document}, {instruction}); LLM(pooler_config=...) also takes a dict')
    attention_backend: str = _arg("auto", "attention implementation: auto and cpu pick the fastest this machine "
                                          "runs (see conveyor.layers.attention)", choices=ATTENTION_BACKENDS)
    max_num_queued_reqs: int | None = _arg(None, "bound on waiting requests (default: unbounded)")
    enable_lora: bool = _arg(False, "serve LoRA adapters of this model (PEFT directories), many in one batch")
    max_loras: int = _arg(4, "LoRA adapters with requests in the running batch at once (adapter slots; vLLM's "
                             "default is 1); more are swapped in least recently used first")
    max_lora_rank: int = _arg(16, "largest LoRA rank served; an adapter above it is refused")
    debug_invariants: bool = _arg(False, "check the scheduler's and KV cache's invariants after every step")
    detokenize: bool = field(default=True, metadata={"cli": False})  # benchmarks turn it off: ids in, ids out
    num_threads: int | None = _arg(None, "torch intra-op threads on CPU (default: all cores)")
    cpu_bind_threads: bool = _arg(True, "pin torch's threads one per CPU while a step runs, when they use every "
                                        "allowed CPU (as vLLM does)")
    cpu_ids: str | None = _arg(None, "CPUs the engine computes on, e.g. '1' or '0,2-3' (default: every CPU it may "
                                     "use); one torch thread per CPU unless --num-threads says otherwise")
    cpu_priority: str = _arg("normal", "the CPU priority the engine's threads compute at: normal, low (nice 19) or "
                                       "idle (SCHED_IDLE: only the cycles other threads leave); see "
                                       "docs/embeddings.md", choices=CPU_PRIORITIES)

    def scheduler_config(self, max_model_len: int, whole_prompts: bool = False) -> SchedulerConfig:
        """The scheduler's config, its policy objects' included (KV eviction from the cache flags)."""
        return SchedulerConfig(**{**self._values_of(SchedulerConfig), "max_model_len": max_model_len,
                                  "whole_prompts": whole_prompts, "eviction": self.cache_config().eviction_config(),
                                  "max_loras": self.max_loras if self.enable_lora else 0})

    def pooler_overrides(self) -> dict | None:
        """``pooler_config`` as a dict (it may be given as JSON text or, from Python, a dict)."""
        if self.pooler_config is None or isinstance(self.pooler_config, dict):
            return self.pooler_config
        import json

        try:
            value = json.loads(self.pooler_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--pooler-config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("--pooler-config must be a JSON object")
        return value

    def cache_config(self) -> CacheConfig:
        return CacheConfig(**self._values_of(CacheConfig))

    def _values_of(self, config_class) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(config_class) if hasattr(self, f.name)}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Add one flag per field (vLLM's names: ``--max-num-seqs``, ``--block-size``, ...) to a parser; the
        fields in ``skip`` are the caller's to add (``conveyor serve``'s ``--model`` also takes NAME=PATH)."""
        group = parser.add_argument_group("engine")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.metadata.get("cli", True) and f.name not in skip:
                options = {k: v for k, v in f.metadata.items() if k != "cli"}
                group.add_argument("--" + f.name.replace("_", "-"), default=f.default,
                                   **_argparse_type(hints[f.name], f.default), **options)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def _argparse_type(hint, default) -> dict:
    """How argparse reads a field of type ``hint``: a flag pair for booleans, else the (non-None) type."""
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction if default else "store_true"}
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    assert len(kinds) == 1 and default is not MISSING, f"no command-line form for {hint}"
    return {"type": kinds[0]}


def parse_cpu_ids(spec: str) -> list[int]:
    """'0,2-3' -> [0, 2, 3] (the Linux cpulist format). Raises ValueError on anything else."""
    ids: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cpu_ids: {spec!r} is not a CPU list like '1' or '0,2-3'")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"cpu_ids: {part!r} is an empty range")
        ids.update(range(first, last + 1))
    return sorted(ids)
