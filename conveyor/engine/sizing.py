"""How big an engine's context and KV cache are, from its ``EngineArgs`` and the loaded model (and what the model
refuses to run beside), and the KV manager that keeps the cache's books."""

from __future__ import annotations

from conveyor.core.config import CacheConfig
from conveyor.core.interfaces import KVManager
from conveyor.core.kv_manager import KVCacheManager
from conveyor.core.sliding_window import freeable_window
from conveyor.engine.args import EngineArgs


def context_length(args: EngineArgs, model_info) -> int:
    """``max_model_len``: the asked length (at most the model's), else the model's context (for a pooling model,
    at most its sentence-transformers input limit, as vLLM takes it). Refuses KV eviction for a sliding-window
    model: eviction drops blocks from the middle of a table, so KV slots stop being positions, and a window is
    counted in positions (refused rather than computed over the wrong keys)."""
    limit = model_info.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > limit:
        raise ValueError(f"max_model_len ({args.max_model_len}) exceeds the model's context ({limit})")
    pooling = model_info.pooling
    if args.max_model_len is None and pooling is not None and pooling.max_seq_length:
        limit = min(limit, pooling.max_seq_length)
    if args.kv_eviction != "none" and any(model_info.layer_windows):
        raise ValueError(f"--kv-eviction {args.kv_eviction} does not run with a sliding-window model "
                         f"({model_info.name}: windows {sorted(set(model_info.layer_windows) - {0})}); "
                         "use --kv-eviction none")
    return args.max_model_len or limit


def num_kv_blocks(args: EngineArgs, cache: CacheConfig, model_info, draft, max_model_len: int) -> int:
    """The KV cache's blocks: ``num_kv_blocks``, else as many as ``kv_cache_memory`` holds for the model and its
    ``draft`` ((model, info) or None: the draft's K/V lives in the same blocks). An encoder keeps no K/V: its
    blocks only count one step's tokens (every request finishes in its step), and it takes no prefix cache."""
    from conveyor.runner.model_runner import ModelRunner

    num_blocks = cache.num_kv_blocks
    if not model_info.causal:
        cache.enable_prefix_caching = False
        budget = max(args.max_num_batched_tokens, max_model_len)
        num_blocks = num_blocks or -(-budget // cache.block_size) + args.max_num_seqs
    elif num_blocks is None:
        per_block = sum(ModelRunner.kv_cache_bytes_per_block(info, cache.block_size, cache.kv_cache_dtype)
                        for info in (model_info, draft[1] if draft else None) if info is not None)
        num_blocks = int(cache.kv_cache_memory * (1 << 30)) // per_block
    if num_blocks * cache.block_size < max_model_len:
        raise ValueError(
            f"KV cache too small: {num_blocks} blocks x {cache.block_size} tokens cannot hold one sequence of "
            f"max_model_len={max_model_len}; raise kv_cache_memory / num_kv_blocks or lower max_model_len"
        )
    return num_blocks


def make_kv_manager(cache: CacheConfig, num_blocks: int, max_model_len: int, model_info, draft) -> KVManager:
    """The KV manager of ``cache.kv_layout``. The paged one gives back blocks outside every window when every layer
    that reads the tables has one (the ``draft``'s too: its K/V lives in the same blocks); an encoder keeps no K/V
    across steps."""
    if cache.kv_layout == "slab":
        from conveyor.core.slab_manager import SlabKVManager

        return SlabKVManager(num_blocks, cache.block_size, max_model_len)
    models = [info.layer_windows for info in (model_info, draft[1] if draft else None) if info is not None]
    window = freeable_window(*models) if cache.free_outside_window and model_info.causal else 0
    return KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, cache.prefix_cache_eviction,
                          sliding_window=window)
