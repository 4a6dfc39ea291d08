"""Paged attention in Triton: one kernel for a whole step's rows (decodes and prompt chunks alike) reading K/V
through the block table, and the KV write that precedes it.

Imported only where Triton is installed (``layers.attention.triton_paged`` imports it lazily). On a GPU the kernels
compile for it; on a CPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, set before this module is
imported), which is how CI tests them against the reference backend. Written to what both Triton 3.6 (the GPU
image's) and 3.9 accept: plain loads and stores with masks, ``tl.dot``, an in-kernel binary search.

The cache is token-major, one layer's ``[2 (K, V), blocks, block_size, KV heads, head_dim]``, as the torch
backends keep it (``layers.attention.kv_layout.TOKEN_MAJOR``).

How the step's rows become programs (the grid is (query blocks, KV heads)): each request's queries are cut into
query blocks of ``BLOCK_Q`` tokens, and one program computes one query block for one KV head, i.e. the
``BLOCK_Q x GROUP`` (query, head) rows that share that KV head's keys, so a key tile is loaded once for the whole
GQA group. Request i's query blocks are programs ``start(i) = query_start[i] // BLOCK_Q + i`` onwards (just
``query_start[i]`` when BLOCK_Q is 1): enough room for ceil(len_i / BLOCK_Q) blocks, and computable on the device
from ``query_start`` alone, so the host builds no per-program table and the grid, ``num_tokens // BLOCK_Q +
num_reqs``, depends only on two counts (a captured decode batch keeps it fixed). A program past its request's last
block returns at once.

::

    query rows    | req 0: 5 tokens        | req 1: 1 | req 2: 3      |      (BLOCK_Q = 2)
    programs      | p0 (q0,q1) p1 (q2,q3) p2 (q4) | p3 (q0) | p4 (q0,q1) p5 (q2) p6 (-) |
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _first_program(query_start, req, BLOCK_Q: tl.constexpr):
    """The first program of request ``req``'s query blocks (module doc); one query per program needs no spare."""
    if BLOCK_Q == 1:
        return query_start
    else:
        return query_start // BLOCK_Q + req


@triton.jit
def _request_of(query_start_ptr, pid, num_reqs, BLOCK_Q: tl.constexpr):
    """The request whose query blocks include program ``pid``: the last i whose first program is <= pid (a binary
    search; request 0 starts at program 0)."""
    lo = 0
    hi = num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _first_program(tl.load(query_start_ptr + mid), mid, BLOCK_Q) <= pid:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b accumulated in float32. PRECISION 0: in the operands' dtype (bfloat16 / float16 on tensor cores);
    1: float32 operands in full precision (a GPU's default for float32 dots is TF32, which would not match the CPU
    reference token for token); 2: bfloat16 operands widened to float32 first, only under the interpreter, whose
    bfloat16 dot reads the bits wrongly (Triton 3.9): the products of bfloat16 values are exact in float32, so
    this computes what the GPU's bfloat16 dot does."""
    if PRECISION == 1:
        return tl.dot(a, b, input_precision="ieee")
    elif PRECISION == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
        scale, num_reqs,
        q_stride_t, q_stride_h, o_stride_t, o_stride_h,
        cache_stride_block, cache_stride_slot, cache_stride_head, table_stride,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, WINDOW: tl.constexpr,
        PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _request_of(query_start_ptr, pid, num_reqs, BLOCK_Q)
    q_begin = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_begin
    first = (pid - _first_program(q_begin, req, BLOCK_Q)) * BLOCK_Q  # this block's first query, within the request
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len  # KV slots cached before this step: query j sits at slot context + j

    rows = tl.arange(0, BLOCK_M)  # row r: query first + r // GROUP, query head kv_head * GROUP + r % GROUP
    q_idx = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    token = (q_begin + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_slot = context + q_idx

    # Keys any row of this block sees: causal up to its last query; with a window, from its first query's window
    # on. Nothing outside [lo, hi) is loaded, so table entries outside it (given back to the null block, or the
    # row's padding) and unwritten slots are never read.
    hi = tl.minimum(context + first + BLOCK_Q, seq_len)
    if WINDOW > 0:
        lo = tl.maximum(context + first - WINDOW + 1, 0)
    else:
        lo = 0
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of each row's scores
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    table_row = block_table_ptr + req * table_stride
    for tile in range(lo // TILE, tl.cdiv(hi, TILE)):
        keys = tile * TILE + tl.arange(0, TILE)
        key_ok = (keys >= lo) & (keys < hi)
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        where = block * cache_stride_block + (keys % BLOCK_SIZE) * cache_stride_slot + kv_head * cache_stride_head
        k = tl.load(k_cache_ptr + where[None, :] + dims[:, None], mask=dim_ok[:, None] & key_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + where[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        scores = _dot(q, k, PRECISION) * scale
        visible = key_ok[None, :] & (keys[None, :] <= q_slot[:, None])
        if WINDOW > 0:
            visible = visible & (keys[None, :] > q_slot[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps m = -inf: subtract 0 instead, so exp gives 0, not NaN
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - shift[:, None])
        alpha = tl.exp(m - shift)
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION)
        m = m_new
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]  # denom is 0 only on masked-off rows
    tl.store(out_ptr + token[:, None] * o_stride_t + head[:, None] * o_stride_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                     cache_stride_block, cache_stride_slot, cache_stride_head,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padded row (a captured decode batch's unused slots): nothing to store
        return
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    dst = (slot // BLOCK_SIZE) * cache_stride_block + (slot % BLOCK_SIZE) * cache_stride_slot \
        + kv_head * cache_stride_head + dims
    t = token.to(tl.int64)
    k = tl.load(k_ptr + t * k_stride_t + kv_head * k_stride_h + dims, mask=dim_ok)
    v = tl.load(v_ptr + t * v_stride_t + kv_head * v_stride_h + dims, mask=dim_ok)
    tl.store(k_cache_ptr + dst, k, mask=dim_ok)
    tl.store(v_cache_ptr + dst, v, mask=dim_ok)


def _precision(dtype: torch.dtype) -> int:
    """``_dot``'s PRECISION for a model dtype."""
    if dtype == torch.float32:
        return 1
    return 2 if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1" else 0


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, KV heads, head_dim] at ``slot_mapping`` [T] (block * block_size + offset; a negative slot
    stores nothing) in a token-major cache [2, blocks, block_size, KV heads, head_dim]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    cache_k, cache_v = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, cache_k, cache_v, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        HEAD_DIM=head_dim, HEAD_DIM_P2=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=cache_k.shape[1])


class LaunchShape:
    """A step's launch constants: how many query tokens a program takes (``block_q``), its rows (``block_m`` =
    block_q x GQA group, padded to a power of two and at least 16, ``tl.dot``'s smallest), and the key tile.

    Decode-only steps take one query per program (``block_m`` = the group, padded): a decode has one query, and
    more would leave rows idle. Steps with prompt chunks take 64 rows, so a chunk's keys are read once per 64 rows.
    """

    TILE = 32

    def __init__(self, group: int, decode_only: bool) -> None:
        group_p2 = triton.next_power_of_2(group)
        self.block_m = max(16, group_p2) if decode_only else max(64, group_p2)
        self.block_q = 1 if decode_only else self.block_m // group

    def grid(self, num_tokens: int, num_reqs: int, num_kv_heads: int) -> tuple[int, int]:
        """(programs over the query blocks (``_first_program``), KV heads)."""
        blocks = num_tokens if self.block_q == 1 else num_tokens // self.block_q + num_reqs
        return blocks, num_kv_heads


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, query_start: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, window: int, shape: LaunchShape,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every query row of a step over its request's paged K/V (already written).

    q [T, H, d]; kv_cache token-major; block_table [requests, max blocks] (int32 or int64); query_start
    [requests + 1] and seq_lens [requests] int32 on q's device (request i's queries are rows query_start[i] ..
    query_start[i + 1] - 1 at KV slots seq_lens[i] - their count ..); ``window`` > 0: each query sees its last
    ``window`` keys. Returns [T, H, d] in q's dtype (into ``out`` when given)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    num_reqs = seq_lens.shape[0]
    q = _last_dim_contiguous(q)
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or num_reqs == 0:
        return out
    cache_k, cache_v = kv_cache[0], kv_cache[1]
    group = num_heads // num_kv_heads
    _paged_attention_kernel[shape.grid(num_tokens, num_reqs, num_kv_heads)](
        out, q, cache_k, cache_v, block_table, seq_lens, query_start, scale, num_reqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), block_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P2=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=cache_k.shape[1], BLOCK_Q=shape.block_q, BLOCK_M=shape.block_m, TILE=LaunchShape.TILE,
        WINDOW=window, PRECISION=_precision(q.dtype))
    return out
