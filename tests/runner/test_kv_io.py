"""``runner.kv_io``: a request's K/V leaves one paged cache and lands in another, whatever the two block sizes and
layouts (token-major for the torch backends, head-major for the native CPU one)."""

import pytest
import torch

from conveyor.layers.attention.kv_layout import HEAD_MAJOR, TOKEN_MAJOR
from conveyor.runner.kv_io import gather_kv, scatter_kv

LAYERS, HEADS, DIM = 3, 2, 4


def cache(num_blocks: int, block_size: int, layout) -> list[torch.Tensor]:
    shape = (2, num_blocks, HEADS, block_size, DIM) if layout is HEAD_MAJOR else (2, num_blocks, block_size, HEADS, DIM)
    assert layout.shape(num_blocks, block_size, HEADS, DIM) == shape  # the layout says what it is
    return [torch.zeros(shape) for _ in range(LAYERS)]


@pytest.mark.parametrize("src_major", [TOKEN_MAJOR, HEAD_MAJOR], ids=lambda layout: layout.name)
@pytest.mark.parametrize("dst_major", [TOKEN_MAJOR, HEAD_MAJOR], ids=lambda layout: layout.name)
def test_round_trip_across_block_sizes_and_layouts(src_major, dst_major):
    torch.manual_seed(0)
    kv = torch.randn(LAYERS, 2, 21, HEADS, DIM)  # 21 tokens: a partial last block either way
    src = cache(10, 8, src_major)
    scatter_kv(src, [7, 2, 5], kv, 8, src_major)
    out = gather_kv(src, [7, 2, 5], 21, 8, src_major)
    assert torch.equal(out, kv)
    dst = cache(12, 4, dst_major)
    blocks = [11, 0, 3, 9, 4, 6]
    scatter_kv(dst, blocks, out, 4, dst_major)
    assert torch.equal(gather_kv(dst, blocks, 21, 4, dst_major), kv)
    untouched = [b for b in range(12) if b not in blocks]
    assert all(float(c[:, untouched].abs().sum()) == 0.0 for c in dst)


def test_another_models_kv_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        scatter_kv(cache(4, 4, TOKEN_MAJOR), [0, 1], torch.zeros(LAYERS, 2, 5, HEADS + 1, DIM), 4, TOKEN_MAJOR)
    with pytest.raises(ValueError, match="do not fit"):
        scatter_kv(cache(4, 4, HEAD_MAJOR), [0], torch.zeros(LAYERS, 2, 5, HEADS, DIM), 4, HEAD_MAJOR)


def test_entries_outside_the_window_are_not_written():
    """A windowed request's table starts with null entries (block 5 here): its handed-over K/V lands only in its
    own blocks, and the null block stays zero."""
    torch.manual_seed(1)
    kv = torch.randn(LAYERS, 2, 10, HEADS, DIM)
    dst = cache(6, 4, TOKEN_MAJOR)
    scatter_kv(dst, [5, 5, 1], kv, 4, TOKEN_MAJOR, skip_block=5)
    assert all(float(c[:, 5].abs().sum()) == 0.0 for c in dst)
    assert torch.equal(gather_kv(dst, [5, 5, 1], 10, 4, TOKEN_MAJOR)[:, :, 8:], kv[:, :, 8:])


def test_int8_rows_travel_whole_and_never_into_a_float_cache():
    """An int8 cache's rows (values and scale bytes: ``kv_quant``) are handed over as they are stored; a float
    engine cannot take them, nor an int8 engine float K/V (the two need the same --kv-cache-dtype)."""
    from conveyor.layers.attention.kv_quant import dequantize_rows, quantize_rows

    torch.manual_seed(0)
    kv = quantize_rows(torch.randn(LAYERS, 2, 9, HEADS, DIM))  # [..., DIM + 4] int8
    int8 = [torch.zeros(2, 6, HEADS, 4, DIM + 4, dtype=torch.int8) for _ in range(LAYERS)]
    scatter_kv(int8, [3, 0, 5], kv, 4, HEAD_MAJOR)
    out = gather_kv(int8, [3, 0, 5], 9, 4, HEAD_MAJOR)
    assert torch.equal(out, kv) and torch.equal(dequantize_rows(out), dequantize_rows(kv))
    with pytest.raises(ValueError, match="same --kv-cache-dtype"):
        scatter_kv(cache(6, 4, HEAD_MAJOR), [0, 1, 2], out, 4, HEAD_MAJOR)
    with pytest.raises(ValueError, match="same --kv-cache-dtype"):
        scatter_kv(int8, [0, 1, 2], torch.zeros(LAYERS, 2, 9, HEADS, DIM + 4), 4, HEAD_MAJOR)
