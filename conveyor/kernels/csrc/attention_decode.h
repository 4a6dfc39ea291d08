// Attention of one query per item (decodes): see attention_common.h for the item and the loop shapes.
#pragma once

#include "attention_bf16.h"
#include "attention_common.h"
#include "attention_int8.h"
#include "attention_mass.h"

namespace cvk {

// One query over kv heads [kvh, kvh_end): rows r = query heads kvh * G .. kvh_end * G. Per chunk of keys, every
// head of the item reads its slice of the same K/V rows, so a chunk streams from memory once, in order.
// C: the cache's elements (T, or int8 rows: keys scored and values summed as stored, attention_int8.h).
template <typename T, int DV, typename C>
void attend_one_query(const AttnArgs& a, const Item& it) {
  constexpr int DM = max_dv<DV>() * W;  // a row's room: D itself for a compiled head size
  const int dv = head_dv<DV>(a), D = dv * W;
  constexpr int KP = (KC + W - 1) / W * W;  // chunk padded to whole score vectors
  // bfloat16 dot products in hardware (attention_bf16.h), for the compiled head sizes (whole 32-value vectors)
  constexpr bool kDpbf16 = kBf16Dot && sizeof(T) == 2 && sizeof(C) == 2 && DV > 0 && DV % 2 == 0;
  constexpr bool kConvert = sizeof(C) != 4 && !kDpbf16;  // rows widened into kbuf / vbuf
  const int G = a.H / a.KVH;
  const int rows = (it.kvh_end - it.kvh) * G;
  const int64_t qs = a.query_start[it.req];
  const int64_t ctx0 = a.seq_lens[it.req] - (a.query_start[it.req + 1] - qs);
  const int64_t end = ctx0 + it.q0 + 1;  // keys [start, end): all earlier ones, or the layer's window
  const int64_t start = a.window > 0 ? std::max<int64_t>(0, end - a.window) : 0;
  const int64_t* table = a.block_table + int64_t(it.req) * a.bt_stride;
  const int64_t hstride = int64_t(a.bs) * kv_row(a);  // from one head's rows of a block to the next head's
  const int row_bytes = int(kv_row(a) * sizeof(C));
  const T* qrow = static_cast<const T*>(a.q) + (qs + it.q0) * a.q_stride + int64_t(it.kvh) * G * D;

  alignas(64) float q[kDpbf16 ? 1 : MAX_QROWS * DM];
  alignas(64) float O[MAX_QROWS * DM];
  alignas(64) float S[MAX_QROWS * KP];
  alignas(64) uint16_t Pb[kDpbf16 ? MAX_QROWS * KP : 1];
  constexpr bool kInt8 = sizeof(C) == 1;
  alignas(64) float kbuf[kConvert && !kInt8 ? KC * DM : 1];
  // int8 rows: the chunk's key and value scales (0 past the chunk's keys), folded into the scores and the
  // probabilities (q.k * ks_j, p_j * vs_j) rather than into every element
  alignas(64) float ks[kInt8 ? KP : 1];
  QueryI16 qi[kInt8 ? MAX_QROWS : 1];  // int8 rows: each query row as int16, for the scores (attention_int8.h)
  alignas(64) float vs[kInt8 ? KP : 1];
  alignas(64) float vbuf[kConvert && !kInt8 ? KC * DM : 1];
  float m[MAX_QROWS], l[MAX_QROWS];
  const C* kbase[KP];
  const C* vbase[KP];
  const float* krow[KP];
  const float* vrow[KP];

  if (!kDpbf16) {
    for (int r = 0; r < rows; r++) load_query_row<T, C>(qrow + r * D, dv, a.scale, q + r * D);
    if constexpr (kInt8)
      for (int r = 0; r < rows; r++) quantize_query(q + r * D, D, qi[r]);
  }
  for (int r = 0; r < rows; r++) {
    for (int d = 0; d < dv; d++) V::zero().store(O + r * D + d * W);
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  // a decode scored for KV eviction keeps its probabilities (attention_mass.h); a request of more tokens whose
  // last tile holds one query is scored after the step, with its other rows
  float* mass = a.query_start[it.req + 1] - qs == 1 ? mass_of(a, it.req) : nullptr;
  MassCapture capture;
  if (mass != nullptr) capture.begin(rows, end);
  int64_t offs[KC], next_offs[KC];
  for (int64_t j0 = start; j0 < end; j0 += KC) {
    const int nk = int(std::min<int64_t>(KC, end - j0));
    const int nk_next = int(std::max<int64_t>(0, std::min<int64_t>(KC, end - j0 - KC)));
    kv_offsets(a, table, j0, nk, offs);
    kv_offsets(a, table, j0 + KC, nk_next, next_offs);
    for (int j = 0; j < KP; j++) {
      if (j < nk) {
        kbase[j] = static_cast<const C*>(a.k_cache) + offs[j];
        vbase[j] = static_cast<const C*>(a.v_cache) + offs[j];
      } else {
        kbase[j] = vbase[j] = reinterpret_cast<const C*>(kZeros);  // zero rows; their scores are masked
      }
    }
    for (int h = it.kvh; h < it.kvh_end; h++) {
      const int r0 = (h - it.kvh) * G;
      float* s0 = S + r0 * KP;
      // this head's K and V rows of the next chunk, asked for over this chunk's work (LineCursor)
      LineCursor pfc;
      for (int j = 0; j < nk_next; j++) {
        pfc.add_row(static_cast<const C*>(a.k_cache) + next_offs[j] + h * hstride, row_bytes);
        pfc.add_row(static_cast<const C*>(a.v_cache) + next_offs[j] + h * hstride, row_bytes);
      }
      {
        // cursor steps: the scores' keys x rows (float32) or keys (bfloat16: stepping once per (row, key) cost
        // more than it hid, 6% of the decode attention; the same change in float32 was 5-7% slower: see
        // docs/kernels.md), then PV's keys (or key pairs)
        const int steps = kDpbf16 ? KP + KP / 2 : G * KP + KP;
        pfc.per = std::max(1, (pfc.n + steps - 1) / steps);
      }
      if constexpr (kDpbf16) {
        const uint16_t* kh[KP];
        for (int j = 0; j < KP; j++) kh[j] = reinterpret_cast<const uint16_t*>(kbase[j]) + (j < nk ? h * hstride : 0);
        scores_bf16<DV>(reinterpret_cast<const uint16_t*>(qrow) + r0 * D, D, G, kh, KP, a.scale, s0, KP, pfc);
      } else if constexpr (kInt8) {
        // integer dot products of the int16 query rows with the int8 keys as stored, times both scales
        const int8_t* kr[KP];
        for (int j = 0; j < KP; j++) {
          kr[j] = j < nk ? kbase[j] + h * hstride : reinterpret_cast<const int8_t*>(kZeros);
          ks[j] = j < nk ? kv_row_scale(kr[j], dv) : 0.f;
        }
        for (int r = r0; r < r0 + G; r++) {
          const V qscale = V::set1(qi[r].scale);
          for (int jg = 0; jg < KP; jg += W) {
            V acc[W];
            for (int u = 0; u < W; u++) {
              acc[u] = int8_dot_lanes(kr[jg + u], qi[r], D);
              pfc.step();
            }
            (V::hsum_lanes(acc) * V::load(ks + jg) * qscale).store(S + r * KP + jg);
          }
        }
      } else {
        for (int j = 0; j < KP; j++) krow[j] = j < nk ? decode_row(kbase[j] + h * hstride, dv, kbuf + j * D) : kZeros;
        for (int r = r0; r < r0 + G; r++) {
          V qr[max_dv<DV>()];
          for (int d = 0; d < dv; d++) qr[d] = V::load(q + r * D + d * W);
          for (int jg = 0; jg < KP; jg += W) {
            V acc[W];
            for (int u = 0; u < W; u++) {
              acc[u] = V::zero();
              for (int d = 0; d < dv; d++) acc[u] = V::fma(qr[d], V::load(krow[jg + u] + d * W), acc[u]);
              pfc.step();
            }
            V::hsum_lanes(acc).store(S + r * KP + jg);
          }
        }
      }
      // online softmax, row by row
      for (int r = r0; r < r0 + G; r++) {
        float* s = S + r * KP;
        for (int j = nk; j < KP; j++) s[j] = -INFINITY;
        V mx = V::set1(m[r]);
        for (int j = 0; j < KP; j += W) mx = V::max(mx, V::load(s + j));
        const float m_new = mx.hmax();  // finite: the first visible key is in the first chunk
        const float alpha = expf(m[r] - m_new);
        const V mn = V::set1(m_new);
        V psum = V::zero();
        for (int j = 0; j < KP; j += W) {
          const V p = V::exp(V::load(s + j) - mn);
          p.store(s + j);
          psum = psum + p;
        }
        l[r] = l[r] * alpha + psum.sum();
        m[r] = m_new;
        if (mass != nullptr) capture.keep(r, int(j0 / KC), s, m_new);
        if (alpha != 1.f) {
          const V al = V::set1(alpha);
          for (int d = 0; d < dv; d++) (V::load(O + r * D + d * W) * al).store(O + r * D + d * W);
        }
      }
      if constexpr (kDpbf16) {
        probs_to_bf16(s0, G, KP, Pb + r0 * KP);
        const uint16_t* vh[KP];
        for (int j = 0; j < KP; j++) vh[j] = reinterpret_cast<const uint16_t*>(vbase[j]) + (j < nk ? h * hstride : 0);
        pv_bf16<DV>(Pb + r0 * KP, KP, G, vh, (nk + 1) & ~1, O + r0 * D, pfc);
        pfc.flush();
      } else {
        if constexpr (kInt8) {  // p_j * vs_j: the probabilities were kept (mass) and summed (l) above
          const int8_t* vr[KP];
          for (int j = 0; j < KP; j++) {
            vr[j] = j < nk ? vbase[j] + h * hstride : reinterpret_cast<const int8_t*>(kZeros);
            vs[j] = j < nk ? kv_row_scale(vr[j], dv) : 0.f;
          }
          for (int r = r0; r < r0 + G; r++)
            for (int j = 0; j < KP; j += W) (V::load(S + r * KP + j) * V::load(vs + j)).store(S + r * KP + j);
          pv_all<DV>(s0, 1, KP, G, vr, nk, O + r0 * D, dv, &pfc);
        } else {
          for (int j = 0; j < nk; j++) vrow[j] = decode_row(vbase[j] + h * hstride, dv, vbuf + j * D);
          pv_all<DV>(s0, 1, KP, G, vrow, nk, O + r0 * D, dv, &pfc);
        }
        pfc.flush();
      }
    }
  }
  if (mass != nullptr) capture.finish(a, it.kvh, it.kvh_end, G, m, l, mass);
  if constexpr (kDpbf16)
    for (int r = 0; r < rows; r++) unpermute_row(O + r * D, D);
  store_rows<T, DV, C>(a, it, qs, rows, O, l);
}

}  // namespace cvk
