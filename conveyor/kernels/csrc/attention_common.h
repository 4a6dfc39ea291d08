// Attention: the shared pieces of the decode (attention_decode.h) and prefill (attention_prefill.h) loops.
#pragma once

#include <algorithm>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "bf16.h"
#include "kernels.h"
#include "vec.h"

namespace cvk {

// Attention. One work item = (request, kv head, tile of queries): its G query heads x up to TQ queries (the
// item's rows) share every K/V row they read. Keys are walked in chunks of KC with an online softmax
// (flash-attention style), so nothing grows with the context, and K/V rows are read straight from the paged
// cache through the block table. Two shapes of inner loop:
//  - one query (decodes): rows = the G heads; scores by dot products, 16 (8) keys at a time reduced with one
//    transpose-add tree; the loop streams K and V from memory once, which is what bounds it.
//  - a tile of queries (prefill chunks): rows = queries x heads, held transposed (rows in vector lanes), so
//    QK^T, the masked online softmax and PV are all full-width vector work, GEMM-like. In bfloat16 on a CPU
//    with AMX, QK^T and PV run on tiles instead (amx_chunk_scores, amx_chunk_pv): 1.7x the vector path.
constexpr int KC = 32;                    // keys per chunk
constexpr int RV_MAX = 2;                 // row vectors of a tile item
constexpr int MAX_ROWS = RV_MAX * W;      // rows of a tile item: 32 (AVX-512) / 16 (AVX2)
constexpr int KB = W == 16 ? 8 : 4;       // keys per register block of the tile QK^T
constexpr int MAX_D = 256;                // the generic head-size path's bound (DV = 0 below)
constexpr int MAX_G = 16;                 // query heads per kv head
constexpr int MAX_QROWS = 64;             // rows (query heads) of a one-query item

alignas(64) const float kZeros[MAX_D] = {};  // a K/V "row" for padding a chunk to full blocks (masked out)

// Head sizes: the loops are templates on DV = D / W, the vectors per row. DV > 0 compiles one head size in
// (64 and 128: every loop over d unrolled, a row's accumulators in registers); DV = 0 is the generic path, for
// any other D that is a multiple of W up to MAX_D (the models' 32, 48, 80, 96, 256 ...), with dv read at run
// time and row buffers sized for MAX_D. The arithmetic is the same, in the same order, either way.
template <int DV>
constexpr int max_dv() { return DV > 0 ? DV : MAX_D / W; }
template <int DV>
inline int head_dv(const AttnArgs& a) { return DV > 0 ? DV : a.D / W; }

struct Item {
  int req, kvh, kvh_end, q0, q1;  // kv heads [kvh, kvh_end), queries [q0, q1) of the request's new tokens
  int64_t cost;
};

// The cache layout is head-major inside a block, [num_blocks, KVH, bs, row] (as vLLM's CPU backend keeps it): one
// head's keys of a block are contiguous, so reading a request's context for a head streams whole pages in order.
// A row is D elements of the cache's type C, or, in an int8 cache (kv_dtype CVK_KV_INT8, C = int8_t), D int8
// values and their float32 scale: D + 4 bytes (cvk.h).
inline int64_t kv_row(const AttnArgs& a) { return a.kv_dtype == CVK_KV_INT8 ? a.D + 4 : a.D; }

// Element offset of the row of position `pos`, head h:
inline int64_t kv_offset(const AttnArgs& a, const int64_t* table, int64_t pos, int h) {
  return ((table[pos / a.bs] * a.KVH + h) * a.bs + pos % a.bs) * kv_row(a);
}

// Offsets (head 0) of the rows of positions [j0, j0 + n): one division, then block by block (a division per key
// cost as much as the rest of the decode loop).
inline void kv_offsets(const AttnArgs& a, const int64_t* table, int64_t j0, int n, int64_t* offs) {
  int64_t b = j0 / a.bs;
  int off = int(j0 - b * a.bs);
  const int64_t row = kv_row(a);
  const int64_t block_elems = int64_t(a.KVH) * a.bs * row;
  for (int j = 0; j < n; j++) {
    offs[j] = table[b] * block_elems + int64_t(off) * row;
    if (++off == a.bs) {
      off = 0;
      b++;
    }
  }
}

// One cache row of D = dv * W values as float32 into dst: bfloat16 widened, int8 times its row's scale.
template <typename C>
inline void load_kv_row(const C* src, int dv, float* dst) {
  if constexpr (sizeof(C) == 1) {
    float scale;
    memcpy(&scale, src + dv * W, sizeof(float));
    const V s = V::set1(scale);
    for (int d = 0; d < dv; d++) (V::load(src + d * W) * s).store(dst + d * W);
  } else {
    for (int d = 0; d < dv; d++) V::load(src + d * W).store(dst + d * W);
  }
}

// An int8 row's scale, after its D = dv * W values.
inline float kv_row_scale(const int8_t* src, int dv) {
  float scale;
  memcpy(&scale, src + dv * W, sizeof(float));
  return scale;
}

// Cache row src of a decode chunk as float32 for its dot products: a pointer into a float32 cache, or the row
// widened into buf (bfloat16). (int8 rows are read as stored: attention_int8.h.)
template <typename C>
inline const float* decode_row(const C* src, int dv, float* buf) {
  if constexpr (sizeof(C) == 4) {
    return reinterpret_cast<const float*>(src);
  } else {
    load_kv_row(src, dv, buf);
    return buf;
  }
}

// The int8 cache's rotation (cvk.h's CVK_KV_INT8): a Walsh-Hadamard transform of each block of b = D & -D values
// (the largest power of two dividing D: all of 64 or 128), unnormalized, butterflies of stride 1, 2, 4, ... in
// place: x[i], x[i + h] <- x[i] + x[i + h], x[i] - x[i + h]. A key row with a few outlier channels spreads them
// over every value of the block, so one scale per row no longer rounds its small channels to nothing. The
// transform is its own inverse up to a factor b (H H = b I), and q.k = (H q).(H k) / b: the loops rotate each
// query row once (with 1 / b in its scale) and each output row once, never a cached row. Every element is one
// float32 add or subtract of the previous stage's, so the torch reference (kv_quant.py) computes the same bits.
inline int kv_rotation_block(int D) { return D & -D; }
inline void kv_rotate(float* x, int D) {
  const int b = kv_rotation_block(D);
  for (int h = 1; h < b; h *= 2)
    for (int i0 = 0; i0 < D; i0 += 2 * h)
      for (int i = i0; i < i0 + h; i++) {
        const float u = x[i], v = x[i + h];
        x[i] = u + v;
        x[i + h] = u - v;
      }
}

// A query row (D values of T) times `scale` into dst: as is, or, for an int8 cache (C = int8_t), rotated like the
// keys, with the rotation's 1 / b folded into the scale (kv_rotate).
template <typename T, typename C>
inline void load_query_row(const T* src, int dv, float scale, float* dst) {
  const int D = dv * W;
  if constexpr (sizeof(C) == 1) scale /= float(kv_rotation_block(D));
  const V s = V::set1(scale);
  for (int d = 0; d < dv; d++) (V::load(src + d * W) * s).store(dst + d * W);
  if constexpr (sizeof(C) == 1) kv_rotate(dst, D);
}

// One head's row x of D = dv * W values (the step's dtype T) into a cache row of type C: copied, rounded to bfloat16
// (a float32 step over a bfloat16 cache), or rotated (kv_rotate) and quantized to int8 with its scale (cvk.h's
// CVK_KV_INT8: scale = max |y| / 127, q = round-half-even(y / scale), a division so that a torch reference computes
// the same integers).
template <typename T, typename C>
inline void store_kv_row(const T* x, int dv, C* dst) {
  if constexpr (sizeof(C) == 1) {
    alignas(64) float y[MAX_D];
    for (int d = 0; d < dv; d++) V::load(x + d * W).store(y + d * W);
    kv_rotate(y, dv * W);
    V amax = V::zero();
    for (int d = 0; d < dv; d++) {
      const V v = V::load(y + d * W);
      amax = V::max(amax, V::max(v, V::zero() - v));
    }
    const float scale = amax.hmax() / 127.f;
    const V s = V::set1(scale);
    for (int d = 0; d < dv; d++) {
      if (scale > 0.f) (V::load(y + d * W) / s).store_i8(dst + d * W);
      else V::zero().store_i8(dst + d * W);
    }
    memcpy(dst + dv * W, &scale, sizeof(float));
  } else if constexpr (sizeof(C) != sizeof(T)) {  // float32 values into a bfloat16 cache (CVK_KV_BF16)
    for (int d = 0; d < dv; d++) V::load(x + d * W).store(dst + d * W);
  } else {
    memcpy(dst, x, sizeof(T) * dv * W);
  }
}

// Float32 rows of keys [j0, j0 + n) of kv head h, padded to `pad` rows with zeros: pointers straight into the
// cache (C = float) or into `buf` after conversion (bfloat16, int8).
template <typename C, int DV>
inline void chunk_rows(const AttnArgs& a, const int64_t* table, const C* base, int h, int64_t j0, int n, int pad,
                       const float** rows, float* buf) {
  const int dv = head_dv<DV>(a), D = dv * W;
  int64_t offs[KC];
  kv_offsets(a, table, j0, n, offs);
  const int64_t head = int64_t(h) * a.bs * kv_row(a);
  for (int j = 0; j < n; j++) {
    const C* src = base + offs[j] + head;
    if constexpr (sizeof(C) == 4) {
      rows[j] = reinterpret_cast<const float*>(src);
    } else {
      load_kv_row(src, dv, buf + j * D);
      rows[j] = buf + j * D;
    }
  }
  for (int j = n; j < pad; j++) rows[j] = kZeros;
}

// The cache lines of the next chunk of a decode item's head (its K and V rows), asked for into L2 a few at a
// time from inside this chunk's loops: `step()` once per inner iteration, `per` lines each, so the requests
// spread over the chunk's compute. Asking for them in bursts (V into L1 before the scores, the next K into L2)
// stalled the core on full fill buffers (perf: a third of the kernel's samples on those prefetches) and left
// memory idle while it computed; spread out, decode attention over DRAM-resident caches took 12-17% less time
// (docs/kernels.md). Into L1 (T0) did no better.
struct LineCursor {
  static constexpr int kMaxLines = 2 * KC * MAX_D * 4 / 64;  // K and V rows of a chunk, float32 at MAX_D
  const char* lines[kMaxLines];
  int n = 0, next = 0, per = 1;
  inline void add_row(const void* row, int bytes) {
    for (int b = 0; b < bytes; b += 64) lines[n++] = static_cast<const char*>(row) + b;
  }
  inline void step() {
    for (const int end = std::min(n, next + per); next < end; next++) _mm_prefetch(lines[next], _MM_HINT_T1);
  }
  inline void flush() {
    for (; next < n; next++) _mm_prefetch(lines[next], _MM_HINT_T1);
  }
};

// O[r] += sum_j P[j * p_stride + r * p_step] * v_j[voff ..] for R rows of DV vectors (O rows ld floats apart),
// accumulating in registers. pfc: a decode item's prefetch cursor, stepped once per key (null for tiles). The
// rows v_j are float32, or an int8 cache's values as stored (E = int8_t: widened in registers, their scales
// already in P), so a decode reads each value row once, into no buffer.
template <int DV, int R, typename E>
inline void pv_block(const float* P, int p_stride, int p_step, const E* const* vrow, int voff, int nk, float* O,
                     int ld, LineCursor* pfc) {
  V acc[R][DV];
  for (int i = 0; i < R; i++)
    for (int d = 0; d < DV; d++) acc[i][d] = V::load(O + i * ld + d * W);
  for (int j = 0; j < nk; j++) {
    V p[R];
    for (int i = 0; i < R; i++) p[i] = V::set1(P[j * p_stride + i * p_step]);
    if (pfc) pfc->step();
    for (int d = 0; d < DV; d++) {
      const V v = V::load(vrow[j] + voff + d * W);
      for (int i = 0; i < R; i++) acc[i][d] = V::fma(p[i], v, acc[i][d]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int d = 0; d < DV; d++) acc[i][d].store(O + i * ld + d * W);
}

// Rows [0, nrows) over the DV vectors at voff of each row, in register blocks of up to RB rows: each V row is
// loaded once per block, so a group of G heads (G <= RB) reads it once.
template <int DV, typename E>
inline void pv_rows(const float* P, int p_stride, int p_step, int nrows, const E* const* vrow, int voff, int nk,
                    float* O, int ld, LineCursor* pfc) {
  constexpr int RB = DV <= 4 ? 4 : (DV <= 8 ? 2 : 1);
  for (int r = 0; r < nrows; r += RB) {
    const float* p = P + r * p_step;
    float* o = O + r * ld;
    switch (std::min(RB, nrows - r)) {
      case 4: pv_block<DV, (RB >= 4 ? 4 : 1), E>(p, p_stride, p_step, vrow, voff, nk, o, ld, pfc); break;
      case 3: pv_block<DV, (RB >= 3 ? 3 : 1), E>(p, p_stride, p_step, vrow, voff, nk, o, ld, pfc); break;
      case 2: pv_block<DV, (RB >= 2 ? 2 : 1), E>(p, p_stride, p_step, vrow, voff, nk, o, ld, pfc); break;
      default: pv_block<DV, 1, E>(p, p_stride, p_step, vrow, voff, nk, o, ld, pfc); break;
    }
  }
}

// All rows: O[r] += sum_j P(j, r) v_j (rows of dv vectors). The generic head size (DV = 0) goes through the row
// in slices of up to 4 vectors, each slice's accumulators in registers: every output still sums its keys in
// order, as a whole-row pass would.
template <int DV, typename E>
inline void pv_all(const float* P, int p_stride, int p_step, int nrows, const E* const* vrow, int nk, float* O,
                   int dv, LineCursor* pfc = nullptr) {
  if constexpr (DV > 0) {
    pv_rows<DV, E>(P, p_stride, p_step, nrows, vrow, 0, nk, O, DV * W, pfc);
  } else {
    for (int d0 = 0; d0 < dv; d0 += 4) {
      const int off = d0 * W, ld = dv * W;
      switch (std::min(4, dv - d0)) {
        case 4: pv_rows<4, E>(P, p_stride, p_step, nrows, vrow, off, nk, O + off, ld, pfc); break;
        case 3: pv_rows<3, E>(P, p_stride, p_step, nrows, vrow, off, nk, O + off, ld, pfc); break;
        case 2: pv_rows<2, E>(P, p_stride, p_step, nrows, vrow, off, nk, O + off, ld, pfc); break;
        default: pv_rows<1, E>(P, p_stride, p_step, nrows, vrow, off, nk, O + off, ld, pfc); break;
      }
    }
  }
}

// Write rows' outputs O[r] / l[r] to their (query, head) place; over an int8 cache (C = int8_t) the outputs are
// sums of rotated values, rotated back here (kv_rotate: H (sum p Hv) / b = sum p v).
// A tile's rows are (query q0 + r / G, head kvh * G + r % G); a one-query item's rows are heads kvh * G + r.
template <typename T, int DV, typename C>
inline void store_rows(const AttnArgs& a, const Item& it, int64_t qs, int nrows, float* O, const float* l) {
  const int dv = head_dv<DV>(a), D = dv * W;
  const int G = a.H / a.KVH;
  const bool one_query = it.q1 - it.q0 == 1;
  for (int r = 0; r < nrows; r++) {
    const int i = one_query ? it.q0 : it.q0 + r / G, h = one_query ? it.kvh * G + r : it.kvh * G + r % G;
    T* dst = static_cast<T*>(a.out) + (qs + i) * a.out_stride + int64_t(h) * D;
    float norm = 1.f / l[r];
    if constexpr (sizeof(C) == 1) {
      kv_rotate(O + r * D, D);
      norm /= float(kv_rotation_block(D));
    }
    const V inv = V::set1(norm);
    for (int d = 0; d < dv; d++) (V::load(O + r * D + d * W) * inv).store(dst + d * W);
  }
}

}  // namespace cvk
