// Attention of a tile of queries per item (prefill chunks): see attention_common.h for the item and the loop
// shapes; in bfloat16 where AMX was granted, QK^T and PV run on tiles (attention_amx.h), elsewhere at the
// avx512bf16 level on VDPBF16PS (attention_bf16.h).
#pragma once

#include "attention_amx.h"
#include "attention_bf16.h"
#include "attention_common.h"

namespace cvk {

// The online softmax of one chunk of a tile item, rows in vector lanes: ST[key][row] holds the chunk's scores
// (times `scale`: the AMX path's come unscaled, so m stays in their units and the scale goes into the exponent,
// one FMA; scale > 0, so the maximum is the same either way) and gets the probabilities; m, l: the rows' running
// maxima and sums; alpha: each row's rescale factor for O. Returns whether any row's maximum moved (else every
// alpha is exp(0) = 1 exactly and O needs no rescale). Not inlined: inside attend_tile its constants took
// registers from the QK^T loop, which then spilled its accumulators (float32 prefill 45% slower, measured).
__attribute__((noinline)) inline bool chunk_softmax(float* ST, int nkp, int rv_n, float scale, V* m, V* l, float* alpha) {
  // four running maxima and sums, nkp being a multiple of KB >= 4: one chain would wait on each op's latency
  static_assert(KB % 4 == 0, "the softmax below takes keys four at a time");
  const V sc = V::set1(scale);
  bool moved = false;
  for (int rv = 0; rv < rv_n; rv++) {
    V mx4[4] = {m[rv], m[rv], m[rv], m[rv]};
    for (int j = 0; j < nkp; j += 4)
      for (int u = 0; u < 4; u++) mx4[u] = V::max(mx4[u], V::load(ST + (j + u) * MAX_ROWS + rv * W));
    const V mx = V::max(V::max(mx4[0], mx4[1]), V::max(mx4[2], mx4[3]));
    const V al = V::exp((m[rv] - mx) * sc);  // 0 on the first chunk (m = -inf, mx finite)
    const V neg_mx = V::zero() - mx * sc;
    V ps4[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
    for (int j = 0; j < nkp; j += 4)
      for (int u = 0; u < 4; u++) {
        float* s = ST + (j + u) * MAX_ROWS + rv * W;
        const V p = V::exp(V::fma(V::load(s), sc, neg_mx));
        p.store(s);
        ps4[u] = ps4[u] + p;
      }
    const V psum = (ps4[0] + ps4[1]) + (ps4[2] + ps4[3]);
    l[rv] = V::fma(l[rv], al, psum);
    moved = moved || V::any_ne(m[rv], mx);
    m[rv] = mx;
    al.store(alpha + rv * W);
  }
  return moved;
}

// A tile of queries: rows r = (query q0 + r / G, head kvh * G + r % G) in vector lanes. Prefetch: a tile of one
// row vector off the AMX path asks for the next chunk's K/V while it computes (below); a separate instantiation,
// so the wider tiles' loops stay as they were (with the cursor in them a 128-query chunk ran 15-25% slower).
// C: the cache's elements (T, or int8 rows dequantized into kbuf / vbuf, never on the AMX tiles).
template <typename T, int DV, typename C, bool Prefetch = false>
void attend_tile(const AttnArgs& a, const Item& it) {
  constexpr int DM = max_dv<DV>() * W;  // a row's room: D itself for a compiled head size
  const int dv = head_dv<DV>(a), D = dv * W;
  constexpr int KP = (KC + KB - 1) / KB * KB;
  const int G = a.H / a.KVH;
  const int64_t qs = a.query_start[it.req];
  const int64_t ctx0 = a.seq_lens[it.req] - (a.query_start[it.req + 1] - qs);
  const int nrows = (it.q1 - it.q0) * G, rv_n = (nrows + W - 1) / W;
  const int64_t end = ctx0 + it.q1;        // keys [0, end) are visible to some row
  const int64_t diag = ctx0 + it.q0;       // keys <= diag are visible to every row
  // A sliding window (a.window > 0): row r sees keys last[r] - window + 1 .. last[r]. The chunks start at the
  // first row's first key, and every row's first key lies in that first chunk (a tile has at most KC queries),
  // so no row meets a chunk with nothing to see before its keys begin. Keys before a row's first are masked.
  const int64_t start = a.window > 0 ? std::max<int64_t>(0, diag - a.window + 1) : 0;
  const int64_t late_first = a.window > 0 ? ctx0 + it.q1 - a.window : 0;  // the last row's first key
  const int64_t* table = a.block_table + int64_t(it.req) * a.bt_stride;
  const C* kc = static_cast<const C*>(a.k_cache);
  const C* vc = static_cast<const C*>(a.v_cache);
  // (a constant false below the avx512bf16 level: the amx branches below are then dead code)
  // (and for the compiled head sizes only: the AMX helpers take D as a template argument, DM below)
  // (windowed layers take the vector path: the tiles read keys in block-aligned groups from chunk starts at
  // multiples of KC, which a window's first key is not)
  const bool amx = kAmx && sizeof(T) == 2 && sizeof(C) == 2 && DV > 0 && g_amx_attention && a.bs % TILE_KEYS == 0 && D % 32 == 0 &&
                   a.window == 0;
  // Without the tiles (Zen 4/5, Cooper Lake, or AMX switched off), bfloat16 rows as stored on VDPBF16PS: q and
  // the probabilities in pairs (AMX's layouts), K pairs broadcast, V in key pairs (the decode loop's pv_bf16);
  // the probabilities are rounded to bfloat16 for PV, as on the tiles.
  constexpr bool kDot = kBf16Dot && sizeof(T) == 2 && sizeof(C) == 2 && DV > 0 && DV % 2 == 0;
  const bool dot = kDot && !amx && g_dot_attention;
  if constexpr (!Prefetch)
    if (!amx && rv_n == 1) return attend_tile<T, DV, C, true>(a, it);

  alignas(64) float QT[DM * MAX_ROWS];   // [d][row], scaled (the vector path)
  alignas(64) uint32_t QT2[sizeof(T) == 2 ? DM / 2 * MAX_ROWS : 1];  // [d pair][row], unscaled (the AMX path)
  alignas(64) uint16_t PT[sizeof(T) == 2 ? MAX_ROWS * KC : 1];         // AMX PV: P^T [row][key], bfloat16
  alignas(64) uint16_t VV[sizeof(T) == 2 ? DM * KC : 1];               // AMX PV: V in VNNI pairs
  alignas(64) float O[MAX_ROWS * DM];
  alignas(64) float ST[KP * MAX_ROWS];  // scores, then probabilities: [key][row]
  alignas(64) float last[MAX_ROWS];     // row r sees keys 0 .. last[r]
  alignas(64) float first[MAX_ROWS];    // with a window, from first[r] on
  alignas(64) float kbuf[sizeof(C) != 4 ? KC * DM : 1];
  alignas(64) float vbuf[sizeof(C) != 4 ? KC * DM : 1];
  alignas(64) float mrow[MAX_ROWS], lrow[MAX_ROWS], alpha[MAX_ROWS];
  const float* krow[KP];
  const float* vrow[KP];

  // The item's q rows are scattered over the step's qkv buffer (a row per token, heads inside it): request them
  // all before reading any, so their cache misses overlap (measured: the fill below took a fifth of the prefill
  // attention time without this).
  for (int r = 0; r < nrows; r++) {
    const char* src = reinterpret_cast<const char*>(static_cast<const T*>(a.q) + (qs + it.q0 + r / G) * a.q_stride +
                                                    int64_t(it.kvh * G + r % G) * D);
    for (int b = 0; b < int(D * sizeof(T)); b += 64) _mm_prefetch(src + b, _MM_HINT_T0);
  }
  const T* qsrc[MAX_ROWS];
  for (int r = 0; r < MAX_ROWS; r++) {
    const bool real = r < nrows;
    const int i = it.q0 + r / G, h = it.kvh * G + r % G;
    qsrc[r] = static_cast<const T*>(a.q) + (qs + i) * a.q_stride + int64_t(h) * D;
    if (!amx && !dot) {
      alignas(64) float qr[DM];
      if (real) load_query_row<T, C>(qsrc[r], dv, a.scale, qr);
      for (int d = 0; d < D; d++) QT[d * MAX_ROWS + r] = real ? qr[d] : 0.f;
    }
    last[r] = float(real ? ctx0 + i : diag);  // padding rows see the first row's keys: finite, ignored
    first[r] = last[r] - float(a.window) + 1.f;
  }
  if constexpr (sizeof(T) == 2 && DV > 0 && DM % 32 == 0)
    if (amx || dot) vnni_queries<DM>(reinterpret_cast<const uint16_t* const*>(qsrc), nrows, QT2);
  for (int r = 0; r < (amx ? MAX_ROWS : nrows) * D; r += W) V::zero().store(O + r);  // AMX: whole tiles
  V m[RV_MAX], l[RV_MAX];
  for (int rv = 0; rv < RV_MAX; rv++) {
    m[rv] = V::set1(-INFINITY);
    l[rv] = V::zero();
  }
  const V neg_inf = V::set1(-INFINITY);
  if (amx) amx_configure(16, 16);
  for (int64_t j0 = start; j0 < end; j0 += KC) {
    const int nk = int(std::min<int64_t>(KC, end - j0));
    const int nkp = (nk + KB - 1) / KB * KB;
    if (!amx && !dot) chunk_rows<C, DV>(a, table, vc, it.kvh, j0, nk, 0, vrow, vbuf);
    if (amx) {
      const uint16_t* kgrp[2] = {nullptr, nullptr};
      for (int g = 0; g < 2; g++) {
        const int64_t pos = j0 + g * TILE_KEYS;
        if (pos < j0 + nk)
          kgrp[g] = reinterpret_cast<const uint16_t*>(kc) + kv_offset(a, table, pos, it.kvh);
      }
      amx_chunk_scores(QT2, kgrp[0], kgrp[1], D, rv_n > 1, ST);  // unscaled: the softmax applies the scale
    }
    if (!amx && !dot) chunk_rows<C, DV>(a, table, kc, it.kvh, j0, nk, nkp, krow, kbuf);
    // The next chunk's K and V rows, asked for over this chunk's QK^T and PV (as decode items do: LineCursor).
    // A tile of few queries (a step verifying speculative tokens: 1 + k queries x G heads) reads as many bytes
    // as it computes with, so without this its time was the reads' plus the arithmetic's. Tiles of two row
    // vectors compute enough to hide the reads.
    LineCursor pfc;
    if constexpr (Prefetch) {
      const int nk_next = int(std::max<int64_t>(0, std::min<int64_t>(KC, end - j0 - KC)));
      int64_t next_offs[KC];
      kv_offsets(a, table, j0 + KC, nk_next, next_offs);
      const int64_t head = int64_t(it.kvh) * a.bs * kv_row(a);
      for (int j = 0; j < nk_next; j++) {
        pfc.add_row(kc + next_offs[j] + head, int(kv_row(a) * sizeof(C)));
        pfc.add_row(vc + next_offs[j] + head, int(kv_row(a) * sizeof(C)));
      }
      // QK^T's d steps (d pairs on VDPBF16PS), then PV's keys (key pairs) per row block
      const int steps = dot ? nkp / KB * (D / 2) + (nrows + 3) / 4 * ((nk + 1) / 2) : nkp / KB * D + (nrows + 3) / 4 * nk;
      pfc.per = std::max(1, (pfc.n + steps - 1) / steps);
    }
    // the chunk's K and V rows as stored, for VDPBF16PS; keys past the chunk's end read zeros (a never-written
    // slot may hold NaN, and 0 * NaN is NaN)
    const uint16_t* kdot[KP];
    const uint16_t* vdot[KP];
    if constexpr (kDot)
      if (dot) {
        int64_t offs[KC];
        kv_offsets(a, table, j0, nk, offs);
        const int64_t head = int64_t(it.kvh) * a.bs * kv_row(a);
        for (int j = 0; j < KP; j++) {
          const bool real = j < nk;
          kdot[j] = real ? reinterpret_cast<const uint16_t*>(kc + offs[j] + head) : reinterpret_cast<const uint16_t*>(kZeros);
          vdot[j] = real ? reinterpret_cast<const uint16_t*>(vc + offs[j] + head) : reinterpret_cast<const uint16_t*>(kZeros);
        }
        tile_scores_bf16<DV, Prefetch>(QT2, reinterpret_cast<const uint32_t* const*>(kdot), nkp, rv_n, ST, pfc);
      }
    // ST[j][rows] = sum_d K[j][d] * QT[d][rows]
    for (int jb = 0; !amx && !dot && jb < nkp; jb += KB) {
      V acc[KB][RV_MAX];
      for (int u = 0; u < KB; u++)
        for (int rv = 0; rv < RV_MAX; rv++) acc[u][rv] = V::zero();
      if (rv_n == 1) {
        for (int d = 0; d < D; d++) {
          const V qv = V::load(QT + d * MAX_ROWS);
          for (int u = 0; u < KB; u++) acc[u][0] = V::fma(V::set1(krow[jb + u][d]), qv, acc[u][0]);
          if constexpr (Prefetch) pfc.step();
        }
      } else {
        for (int d = 0; d < D; d++) {
          V qv[RV_MAX];
          for (int rv = 0; rv < RV_MAX; rv++) qv[rv] = V::load(QT + d * MAX_ROWS + rv * W);
          for (int u = 0; u < KB; u++) {
            const V kb = V::set1(krow[jb + u][d]);
            for (int rv = 0; rv < RV_MAX; rv++) acc[u][rv] = V::fma(kb, qv[rv], acc[u][rv]);
          }
        }
      }
      for (int u = 0; u < KB; u++)
        for (int rv = 0; rv < rv_n; rv++) acc[u][rv].store(ST + (jb + u) * MAX_ROWS + rv * W);
    }
    // causal mask where the chunk reaches past the diagonal, and the padding keys
    if (j0 + nk - 1 > diag || nk < nkp) {
      for (int j = 0; j < nkp; j++) {
        const V pos = V::set1(j < nk ? float(j0 + j) : INFINITY);
        for (int rv = 0; rv < rv_n; rv++) {
          float* s = ST + j * MAX_ROWS + rv * W;
          V::blend_gt(pos, V::load(last + rv * W), neg_inf, V::load(s)).store(s);
        }
      }
    }
    // the window's mask where the chunk starts before some row's first key
    if (a.window > 0 && j0 < late_first) {
      for (int j = 0; j < nk; j++) {
        const V pos = V::set1(float(j0 + j));
        for (int rv = 0; rv < rv_n; rv++) {
          float* s = ST + j * MAX_ROWS + rv * W;
          V::blend_gt(V::load(first + rv * W), pos, neg_inf, V::load(s)).store(s);
        }
      }
    }
    // online softmax (the AMX and VDPBF16PS scores come unscaled; the vector path's q is pre-scaled)
    const bool rescale = chunk_softmax(ST, nkp, rv_n, amx || dot ? a.scale : 1.f, m, l, alpha);
    if (j0 > 0 && rescale)
      for (int r = 0; r < nrows; r++) {
        const V al = V::set1(alpha[r]);
        for (int d = 0; d < dv; d++) (V::load(O + r * D + d * W) * al).store(O + r * D + d * W);
      }
    if (amx) {
      const uint16_t* vraw[KC];
      int64_t offs[KC];
      kv_offsets(a, table, j0, nk, offs);
      const int64_t head = int64_t(it.kvh) * a.bs * D;
      for (int j = 0; j < nk; j++) vraw[j] = reinterpret_cast<const uint16_t*>(vc) + offs[j] + head;
      vnni_values<DM>(vraw, nk, VV);
      transpose_probs(ST, nk, rv_n, PT);
      amx_chunk_pv(PT, VV, D, rv_n > 1, O);
      continue;
    }
    if constexpr (kDot)
      if (dot) {
        transpose_probs(ST, nk, rv_n, PT);
        pv_bf16<DV>(PT, KC, nrows, vdot, (nk + 1) & ~1, O, pfc);  // O rows come out pair-interleaved
        if constexpr (Prefetch) pfc.flush();
        continue;
      }
    pv_all<DV>(ST, MAX_ROWS, 1, nrows, vrow, nk, O, dv, Prefetch ? &pfc : nullptr);
    if constexpr (Prefetch) pfc.flush();
  }
  for (int rv = 0; rv < rv_n; rv++) l[rv].store(lrow + rv * W);
  if constexpr (kDot)
    if (dot)
      for (int r = 0; r < nrows; r++) unpermute_row(O + r * D, D);
  (void)mrow;
  store_rows<T, DV, C>(a, it, qs, nrows, O, lrow);
  if (amx) amx_release();
}

}  // namespace cvk
