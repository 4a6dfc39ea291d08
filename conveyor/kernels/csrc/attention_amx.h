// Prefill attention's QK^T and PV on AMX tiles (bfloat16), for attention_prefill.h: compiled at the avx512bf16
// level only (a per-ISA file); other levels get stubs that attend_tile's `amx` branches, constant false there,
// never reach.
#pragma once

#include "amx.h"
#include "attention_common.h"

namespace cvk {

#if defined(CVK_AVX512BF16)
constexpr int TILE_KEYS = 16;  // keys per AMX tile: one group must sit inside one cache block (bs % 16 == 0)

// S^T[key][row] = K[key] . Q[row] for one chunk of KC = 32 keys (two groups of 16) and up to 32 rows (two
// groups of 16): TDPBF16PS with K rows as the A operand, loaded straight from the cache (a head's rows of a
// block are contiguous, D * 2 bytes apart), and q in VNNI pairs (qt2 [D / 2][MAX_ROWS]) as B, so the result comes
// out in ST's own [key][row] layout and the softmax below is unchanged. k0, k1: the first row of key group 0 and 1,
// or null when the group has no visible key (its ST rows are not written: they are masked). Unscaled.
// Tiles: 0, 1 = K groups; 2, 3 = q row groups; 4 + 2 g + rg = the S^T block of (key group g, row group rg).
__attribute__((target("amx-tile,amx-bf16")))
inline void amx_chunk_scores(const uint32_t* qt2, const uint16_t* k0, const uint16_t* k1, int D, bool two_row_groups,
                      float* ST) {
  const int64_t kstride = int64_t(D) * 2, qstride = MAX_ROWS * 4, sstride = MAX_ROWS * 4;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int db = 0; db < D / 32; db++) {
    const uint32_t* q = qt2 + int64_t(db) * 16 * MAX_ROWS;
    _tile_loadd(2, q, qstride);
    if (two_row_groups) _tile_loadd(3, q + 16, qstride);
    if (k0 != nullptr) {
      _tile_loadd(0, k0 + db * 32, kstride);
      _tile_dpbf16ps(4, 0, 2);
      if (two_row_groups) _tile_dpbf16ps(5, 0, 3);
    }
    if (k1 != nullptr) {
      _tile_loadd(1, k1 + db * 32, kstride);
      _tile_dpbf16ps(6, 1, 2);
      if (two_row_groups) _tile_dpbf16ps(7, 1, 3);
    }
  }
  if (k0 != nullptr) {
    _tile_stored(4, ST, sstride);
    if (two_row_groups) _tile_stored(5, ST + 16, sstride);
  }
  if (k1 != nullptr) {
    _tile_stored(6, ST + TILE_KEYS * MAX_ROWS, sstride);
    if (two_row_groups) _tile_stored(7, ST + TILE_KEYS * MAX_ROWS + 16, sstride);
  }
}

// Transpose 16 x 16 32-bit values in registers: on entry r[i] = row i; on return r[k] = column kTransposedCol[k]
// (the last step leaves columns in this order; callers index by it instead of paying for a final permute).
constexpr int kTransposedCol[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
inline void transpose16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int u = 0; u < 2; u++) {
      r[i + u] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + u]), _mm512_castps_pd(t[i + 2 + u])));
      r[i + 2 + u] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + u]), _mm512_castps_pd(t[i + 2 + u])));
    }
  // r[4q + c] now holds, in 128-bit lane L, elements 4q .. 4q + 3 of row 4L + (0, 2, 1, 3)[c]
  for (int i = 0; i < 16; i += 8)
    for (int u = 0; u < 4; u++) {
      t[i + u] = _mm512_shuffle_f32x4(r[i + u], r[i + 4 + u], 0x88);
      t[i + 4 + u] = _mm512_shuffle_f32x4(r[i + u], r[i + 4 + u], 0xdd);
    }
  for (int u = 0; u < 8; u++) {
    r[u] = _mm512_shuffle_f32x4(t[u], t[u + 8], 0x88);
    r[u + 8] = _mm512_shuffle_f32x4(t[u], t[u + 8], 0xdd);
  }
}

// P^T for the AMX PV: pt[row][key] (bfloat16, 32 keys per row) from st[key][row] (float32, rows in lanes), keys
// >= nk as 0. Sixteen rows x sixteen keys at a time: a 16 x 16 transpose in registers, then one conversion per row.
inline void transpose_probs(const float* st, int nk, int row_groups, uint16_t* pt) {
  for (int rg = 0; rg < row_groups; rg++)
    for (int kb = 0; kb < 2; kb++) {
      __m512 r[16];
      for (int i = 0; i < 16; i++) {
        const int j = kb * 16 + i;
        r[i] = j < nk ? _mm512_loadu_ps(st + j * MAX_ROWS + rg * 16) : _mm512_setzero_ps();
      }
      transpose16x16(r);
      for (int k = 0; k < 16; k++)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pt + (rg * 16 + kTransposedCol[k]) * KC + kb * 16),
                            (__m256i)_mm512_cvtneps_pbh(r[k]));
    }
}

// q of a tile item in AMX's VNNI pair layout: qt2[d pair][row] = (q[row][2 p], q[row][2 p + 1]) for MAX_ROWS rows,
// rows >= nrows as zeros. Sixteen rows x sixteen pairs at a time, transposed in registers (a scalar fill of the
// 1024 pairs took 7% of the prefill attention samples).
template <int D>
inline void vnni_queries(const uint16_t* const* qrow, int nrows, uint32_t* qt2) {
  for (int rg = 0; rg < MAX_ROWS / 16; rg++)
    for (int pb = 0; pb < D / 32; pb++) {
      __m512 r[16];
      for (int i = 0; i < 16; i++) {
        const int row = rg * 16 + i;
        r[i] = row < nrows ? _mm512_castsi512_ps(_mm512_loadu_si512(qrow[row] + pb * 32)) : _mm512_setzero_ps();
      }
      transpose16x16(r);
      for (int k = 0; k < 16; k++) _mm512_storeu_ps(qt2 + (pb * 16 + kTransposedCol[k]) * MAX_ROWS + rg * 16, r[k]);
    }
}

// V of a chunk in AMX's VNNI layout: vv[d block][key pair][16 d x 2 keys] = (v[2p][d], v[2p + 1][d]), rows
// >= nk as zeros (a never-written slot may hold NaN, and 0 * NaN is NaN).
template <int D>
inline void vnni_values(const uint16_t* const* vrow, int nk, uint16_t* vv) {
  alignas(64) static const uint16_t kInterleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kInterleave);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int p = 0; p < KC / 2; p++) {
    const uint16_t* a = 2 * p < nk ? vrow[2 * p] : nullptr;
    const uint16_t* b = 2 * p + 1 < nk ? vrow[2 * p + 1] : nullptr;
    for (int h = 0; h < D / 32; h++) {
      const __m512i za = a ? _mm512_loadu_si512(a + h * 32) : _mm512_setzero_si512();
      const __m512i zb = b ? _mm512_loadu_si512(b + h * 32) : _mm512_setzero_si512();
      _mm512_storeu_si512(vv + ((2 * h) * (KC / 2) + p) * 32, _mm512_permutex2var_epi16(za, lo, zb));
      _mm512_storeu_si512(vv + ((2 * h + 1) * (KC / 2) + p) * 32, _mm512_permutex2var_epi16(za, hi, zb));
    }
  }
}

// O[rows][D] (float32, in memory) += P V for one chunk of 32 keys on AMX: pt [32 rows][32 keys] as A, vv as B.
// Tiles: 0, 2 = P row groups; 1 = a V block; 4, 5 = the O blocks, loaded, accumulated, stored.
__attribute__((target("amx-tile,amx-bf16")))
inline void amx_chunk_pv(const uint16_t* pt, const uint16_t* vv, int D, bool two_row_groups, float* O) {
  const int64_t ostride = int64_t(D) * 4;
  _tile_loadd(0, pt, KC * 2);
  if (two_row_groups) _tile_loadd(2, pt + 16 * KC, KC * 2);
  for (int dc = 0; dc < D / 16; dc++) {
    _tile_loadd(1, vv + dc * (KC / 2) * 32, 64);
    _tile_loadd(4, O + dc * 16, ostride);
    _tile_dpbf16ps(4, 0, 1);
    _tile_stored(4, O + dc * 16, ostride);
    if (two_row_groups) {
      _tile_loadd(5, O + 16 * D + dc * 16, ostride);
      _tile_dpbf16ps(5, 2, 1);
      _tile_stored(5, O + 16 * D + dc * 16, ostride);
    }
  }
}
#else
constexpr int TILE_KEYS = 16;
inline void amx_chunk_scores(const uint32_t*, const uint16_t*, const uint16_t*, int, bool, float*) { abort(); }
inline void transpose_probs(const float*, int, int, uint16_t*) { abort(); }
template <int D>
inline void vnni_queries(const uint16_t* const*, int, uint32_t*) { abort(); }
template <int D>
inline void vnni_values(const uint16_t* const*, int, uint16_t*) { abort(); }
inline void amx_chunk_pv(const uint16_t*, const uint16_t*, int, bool, float*) { abort(); }
#endif

}  // namespace cvk
