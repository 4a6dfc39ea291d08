"""Sliding-window attention as the KV cache sees it: which of a request's blocks no layer reads again. PURE PYTHON.

A layer with window ``w`` lets the query at position ``p`` see keys ``p - w + 1 .. p`` (``layers.attention.base``).
When every layer of every model that shares the block tables (the target, and a draft model) has a window, the
keys before ``p - W + 1``, ``W`` the largest window, are read by no query at ``p`` or later: a request whose next
token to compute is at ``p`` needs none of the blocks wholly before that key. ``KVCacheManager`` gives those blocks
back to the pool as the request advances (chunked prefill through a long prompt, then decode), so a long request
holds about ``W / block_size + 1`` blocks plus its step's tokens, not its history.

The table keeps its length (entry ``i`` stays token block ``i``, so slots stay positions): a freed entry points at
the null block, a block outside the pool (id ``num_blocks``) that the runner allocates zeroed and nothing ever
writes. Every attention backend masks the keys there; zeros keep a masked score's weight times V at exactly 0,
where a reused block's K/V (or uninitialised memory: NaN) would turn it into NaN.

A model with a layer that attends to every earlier key (Gemma 3's global layers, Qwen2.5's layers past
``max_window_layers``) frees nothing here: one table per request serves every layer. vLLM's hybrid KV cache manager
keeps one table per group of same-kind layers instead, so the local layers hold only their window;
docs/models.md says what that would save and why conveyor does not (yet).

Prefix caching: a block's chained key names every token before it, so a cached block is right at its position
whatever else is cached. A hit of ``k`` blocks needs only the blocks its window reaches, the last
``cdiv(W - 1, block_size)`` (vLLM's ``SlidingWindowManager.find_longest_cache_hit`` looks the same way), and the
entries before them are null from the start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

Block = TypeVar("Block")


def freeable_window(*models_layer_windows: Sequence[int]) -> int:
    """The window every layer of these models attends within (the largest of their windows), or 0 when some layer
    attends to every earlier key: then no block is ever outside every window. Each argument is one model's
    per-layer windows (``ModelInfo.layer_windows``: 0 for a full-attention layer; empty when none has a window)."""
    windows = [w for layers in models_layer_windows for w in (layers or (0,))]
    return 0 if not windows or min(windows) == 0 else max(windows)


class SlidingWindow:
    """The block arithmetic of one window ``window`` over blocks of ``block_size`` tokens."""

    def __init__(self, window: int, block_size: int) -> None:
        if window < 1 or block_size < 1:
            raise ValueError(f"window and block_size must be >= 1, got {window}, {block_size}")
        self.window = window
        self.block_size = block_size

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks that no query at position ``num_computed_tokens`` or later reads: those wholly before
        the first key that query sees."""
        return max(0, (num_computed_tokens - self.window + 1) // self.block_size)

    def longest_hit(self, hashes: Sequence[bytes], lookup: Callable[[bytes], Block | None], null: Block) -> list[Block]:
        """The longest prefix of a request (full blocks with keys ``hashes``) whose last block and the blocks its
        window reaches are cached: its table, ``null`` for the blocks before the window, then those cached blocks
        ([] when there is no hit).

        Scans from the right: the first run of cached blocks, found leftwards, that reaches back to the first block
        its end's window needs is the longest hit (a shorter end in the same run needs no fewer blocks)."""
        found: list[Block] = []  # the current run of cached blocks, rightmost first
        end = len(hashes)  # the run ends before block `end`
        for i in range(len(hashes) - 1, -1, -1):
            block = lookup(hashes[i])
            if block is None:
                found, end = [], i
                continue
            found.append(block)
            skipped = self.num_skipped_blocks(end * self.block_size)
            if i <= skipped:  # blocks skipped .. end - 1 are all cached
                return [null] * skipped + found[::-1][skipped - i:]
        return []
