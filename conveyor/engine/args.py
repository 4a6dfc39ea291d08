"""``EngineArgs``: every knob of an engine in one flat dataclass (the CLI, ``LLM`` and the server share it)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from conveyor.core.config import KV_LAYOUTS, POLICIES, CacheConfig, SchedulerConfig


@dataclass
class EngineArgs:
    """Engine settings, named as vLLM names them. ``model``: a model name, a GGUF file (or a directory holding
    one) or a Hugging Face directory; None is the default model, SmolLM2-135M-Instruct (``models/sources.py``)."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "auto"  # "auto": CUDA when available, else CPU
    seed: int = 0
    policy: str = "chunked"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    long_prefill_token_threshold: int = 0
    max_wait_ms: float = 0.0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: float = 1.0  # GiB
    enable_prefix_caching: bool = True
    kv_layout: str = "paged"
    attention_backend: str = "auto"
    max_num_queued_reqs: int | None = None  # bound on waiting requests; None: unbounded
    debug_invariants: bool = False  # run check_invariants() after every step
    detokenize: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU; None: all cores

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            policy=self.policy,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_wait_ms=self.max_wait_ms,
        )

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory=self.kv_cache_memory,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_layout=self.kv_layout,
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add the engine flags (vLLM's names: ``--max-num-seqs``, ``--block-size``, ...) to a parser."""
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None, help="a model name (SmolLM2-135M-Instruct, the default; "
                       "conveyor-embedded-llama-40m-random, random weights, the benchmarks' default), a GGUF file or a "
                       "directory holding one, or a Hugging Face model directory")
        g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
        g.add_argument("--device", default="auto")
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--policy", default="chunked", choices=POLICIES)
        g.add_argument("--max-num-seqs", type=int, default=256)
        g.add_argument("--max-num-batched-tokens", type=int, default=2048)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--long-prefill-token-threshold", type=int, default=0)
        g.add_argument("--max-wait-ms", type=float, default=0.0)
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--num-kv-blocks", type=int, default=None)
        g.add_argument("--kv-cache-memory", type=float, default=1.0, help="KV cache size in GiB")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        g.add_argument("--kv-layout", default="paged", choices=KV_LAYOUTS)
        g.add_argument("--attention-backend", default="auto")
        g.add_argument("--max-num-queued-reqs", type=int, default=None)
        g.add_argument("--debug-invariants", action="store_true")
        g.add_argument("--num-threads", type=int, default=None)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})
