// The one-query attention's bfloat16 dot products on VDPBF16PS (CVK_AVX512BF16 only: a per-ISA file; other
// levels get declarations alone, for branches that are never instantiated there).
#pragma once

#include "attention_common.h"

namespace cvk {

// Prefill tiles' QK^T and PV on VDPBF16PS where AMX tiles do not run them (avx512bf16 only; a no-op elsewhere):
// on by default, switchable (cvk_set_dot_attention) so tests and benchmarks can run the float32 FMA loop too.
inline bool g_dot_attention = true;

#if defined(CVK_AVX512BF16)
// bfloat16 dot products in hardware (VDPBF16PS: 32 products per instruction, no conversions): scores of the
// G rows of one kv head over a chunk of keys; q rows and K rows are bfloat16 as stored.
template <int DV>
inline void scores_bf16(const uint16_t* q, int64_t q_head_stride, int G, const uint16_t* const* krow, int kp,
                        float scale, float* S, int s_stride, LineCursor& pfc) {
  constexpr int D2 = DV / 2;  // 32 bfloat16 per vector
  for (int r = 0; r < G; r++) {
    __m512bh qr[D2 > 0 ? D2 : 1];
    for (int d = 0; d < D2; d++) qr[d] = (__m512bh)_mm512_loadu_si512(q + r * q_head_stride + d * 32);
    for (int jg = 0; jg < kp; jg += W) {
      V acc[W];
      for (int u = 0; u < W; u++) {
        __m512 x = _mm512_setzero_ps();
        for (int d = 0; d < D2; d++) x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_loadu_si512(krow[jg + u] + d * 32), qr[d]);
        if (r == 0) pfc.step();  // once per key, not per (row, key): see attend_one_query's steps
        acc[u] = {x};
      }
      (V::hsum_lanes(acc) * V::set1(scale)).store(S + r * s_stride + jg);
    }
  }
}

// O[r] += P[r] V over a chunk of keys taken in pairs (VDPBF16PS on (p_j, p_j+1) x (v_j[d], v_j+1[d])).
// O rows stay in the pair-interleaved order these products produce: see unpermute_row.
template <int DV, int R>
inline void pv_bf16_block(const uint16_t* Pb, int pb_stride, const uint16_t* const* vrow, int kp, float* O,
                          LineCursor& pfc) {
  constexpr int D = DV * W, D2 = DV / 2;
  __m512 acc[R][DV];
  for (int i = 0; i < R; i++)
    for (int d = 0; d < DV; d++) acc[i][d] = _mm512_loadu_ps(O + i * D + d * W);
  for (int j = 0; j < kp; j += 2) {
    __m512i lo[D2], hi[D2];
    for (int d = 0; d < D2; d++) {
      const __m512i v0 = _mm512_loadu_si512(vrow[j] + d * 32), v1 = _mm512_loadu_si512(vrow[j + 1] + d * 32);
      lo[d] = _mm512_unpacklo_epi16(v0, v1);
      hi[d] = _mm512_unpackhi_epi16(v0, v1);
    }
    pfc.step();
    for (int i = 0; i < R; i++) {
      uint32_t pair;
      memcpy(&pair, Pb + i * pb_stride + j, 4);
      const __m512bh p = (__m512bh)_mm512_set1_epi32(int(pair));
      for (int d = 0; d < D2; d++) {
        acc[i][2 * d] = _mm512_dpbf16_ps(acc[i][2 * d], (__m512bh)lo[d], p);
        acc[i][2 * d + 1] = _mm512_dpbf16_ps(acc[i][2 * d + 1], (__m512bh)hi[d], p);
      }
    }
  }
  for (int i = 0; i < R; i++)
    for (int d = 0; d < DV; d++) _mm512_storeu_ps(O + i * D + d * W, acc[i][d]);
}

// All rows' O += P V (rows nrows, Pb [row][pb_stride] bfloat16 probabilities) in register blocks of RB rows.
template <int DV>
inline void pv_bf16(const uint16_t* Pb, int pb_stride, int nrows, const uint16_t* const* vh, int kp2, float* O,
                    LineCursor& pfc) {
  constexpr int D = DV * W;
  constexpr int RB = DV <= 4 ? 4 : 2;
  for (int r = 0; r < nrows; r += RB) {
    const uint16_t* pb = Pb + r * pb_stride;
    float* o = O + r * D;
    switch (std::min(RB, nrows - r)) {
      case 4: pv_bf16_block<DV, (RB >= 4 ? 4 : 1)>(pb, pb_stride, vh, kp2, o, pfc); break;
      case 3: pv_bf16_block<DV, (RB >= 3 ? 3 : 1)>(pb, pb_stride, vh, kp2, o, pfc); break;
      case 2: pv_bf16_block<DV, 2>(pb, pb_stride, vh, kp2, o, pfc); break;
      default: pv_bf16_block<DV, 1>(pb, pb_stride, vh, kp2, o, pfc); break;
    }
  }
}

// Probabilities S [rows][kp] (kp a multiple of 32) rounded to bfloat16 for pv_bf16.
inline void probs_to_bf16(const float* S, int rows, int kp, uint16_t* Pb) {
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < kp; j += 32)
      _mm512_storeu_si512(Pb + r * kp + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(S + r * kp + j + 16),
                                                                       _mm512_loadu_ps(S + r * kp + j)));
}

// A prefill tile's scores on VDPBF16PS (avx512bf16 without AMX tiles, attention_prefill.h): ST[key][row] =
// K[key] . q[row] for nkp keys (a multiple of KB) and rv_n row vectors, q in pairs of dimensions per row (qt2
// [D / 2][MAX_ROWS], vnni_queries' layout), each key row's pair (k[2p], k[2p + 1]) read as one 32-bit value and
// broadcast: half the instructions of the float32 FMA loop, and the K rows need no widening. Unscaled.
// Step: a prefetching tile's cursor steps once per pair of dimensions (a separate instantiation, as the vector
// loop's).
template <int DV, bool Step>
inline void tile_scores_bf16(const uint32_t* qt2, const uint32_t* const* krow, int nkp, int rv_n, float* ST,
                             LineCursor& pfc) {
  constexpr int D2 = DV * W / 2;
  for (int jb = 0; jb < nkp; jb += KB) {
    __m512 acc[KB][RV_MAX];
    for (int u = 0; u < KB; u++)
      for (int rv = 0; rv < RV_MAX; rv++) acc[u][rv] = _mm512_setzero_ps();
    if (rv_n == 1) {
      for (int d = 0; d < D2; d++) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qt2 + d * MAX_ROWS);
        for (int u = 0; u < KB; u++)
          acc[u][0] = _mm512_dpbf16_ps(acc[u][0], qv, (__m512bh)_mm512_set1_epi32(int(krow[jb + u][d])));
        if constexpr (Step) pfc.step();
      }
    } else {
      for (int d = 0; d < D2; d++) {
        __m512bh qv[RV_MAX];
        for (int rv = 0; rv < RV_MAX; rv++) qv[rv] = (__m512bh)_mm512_loadu_si512(qt2 + d * MAX_ROWS + rv * W);
        for (int u = 0; u < KB; u++) {
          const __m512bh kb = (__m512bh)_mm512_set1_epi32(int(krow[jb + u][d]));
          for (int rv = 0; rv < RV_MAX; rv++) acc[u][rv] = _mm512_dpbf16_ps(acc[u][rv], qv[rv], kb);
        }
      }
    }
    for (int u = 0; u < KB; u++)
      for (int rv = 0; rv < rv_n; rv++) _mm512_storeu_ps(ST + (jb + u) * MAX_ROWS + rv * W, acc[u][rv]);
  }
}

// Undo the pair interleave of pv_bf16_block: per 32 values, lo holds d = 8k + {0..3}, hi d = 8k + 4 + {0..3}.
inline void unpermute_row(float* o, int D) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int d = 0; d < D; d += 32) {
    const __m512 lo = _mm512_loadu_ps(o + d), hi = _mm512_loadu_ps(o + d + 16);
    _mm512_storeu_ps(o + d, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(o + d + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}
#else
// Other levels: declared so the callers' discarded `if constexpr (kDpbf16)` branches name them; never defined.
template <int DV>
void scores_bf16(const uint16_t* q, int64_t q_head_stride, int G, const uint16_t* const* krow, int kp, float scale,
                 float* S, int s_stride, LineCursor& pfc);
template <int DV>
void pv_bf16(const uint16_t* Pb, int pb_stride, int nrows, const uint16_t* const* vh, int kp2, float* O,
             LineCursor& pfc);
void unpermute_row(float* o, int D);
template <int DV, bool Step>
void tile_scores_bf16(const uint32_t* qt2, const uint32_t* const* krow, int nkp, int rv_n, float* ST, LineCursor& pfc);
void probs_to_bf16(const float* S, int rows, int kp, uint16_t* Pb);
#endif

}  // namespace cvk
