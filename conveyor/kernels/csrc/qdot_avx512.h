// The integer dot products of the quantized GEMM (gemm_quant.cpp) at 512 bits: one 64-byte load is 16 columns x
// 4 k, multiplied against 4 activation bytes broadcast to every lane, by VPDPBUSD where the level has
// AVX512_VNNI (CVK_VNNI), by VPMADDUBSW + VPMADDWD otherwise. Included by qdot.h only.
#pragma once

namespace cvk {
namespace qdot {

constexpr int kRows = 4;  // activation rows per register tile: 8 weight + 4 accumulator vectors + temporaries

// 16 integers n (|n| <= kActMax) -> their base-255 digits (qdot.h), stored as int8.
inline void store_digits(__m512i n, int8_t* hi, int8_t* lo) {
  const __m512i h = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(1.f / kDigit)));
  const __m512i l = _mm512_sub_epi32(n, _mm512_sub_epi32(_mm512_slli_epi32(h, 8), h));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtsepi32_epi8(h));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtsepi32_epi8(l));
}

// One block of 32 floats -> its integers n (qdot.h) as digits, its unit d (max |x| / kActMax) and d * sum(n).
inline void quantize_block(const float* x, int8_t* hi, int8_t* lo, float* d, float* s) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float id = amax > 0.f ? float(kActMax) / amax : 0.f;
  const __m512i n0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
  const __m512i n1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
  store_digits(n0, hi, lo);
  store_digits(n1, hi + 16, lo + 16);
  *d = amax / float(kActMax);
  *s = *d * float(_mm512_reduce_add_epi32(_mm512_add_epi32(n0, n1)));
}

// The block's 8 quads of weights, 16 columns x 4 k each, as unsigned bytes.
template <bool Q4>
inline void load_block(const uint8_t* qs, __m512i w[8]) {
  if constexpr (Q4) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int u = 0; u < 4; u++) {
      const __m512i v = _mm512_loadu_si512(qs + u * 64);
      w[2 * u] = _mm512_and_si512(v, m4);
      w[2 * u + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
  } else {
    for (int t = 0; t < 8; t++) w[t] = _mm512_loadu_si512(qs + t * 64);
  }
}

// Sum over the block's 32 k of w (unsigned) x one digit of x (signed), per column, as int32 lanes.
template <bool Q4>
inline __m512i digit_dot(const __m512i w[8], const int8_t* xq) {
  int32_t quads[8];
  memcpy(quads, xq, 32);
  __m512i d = _mm512_setzero_si512();
#if defined(CVK_VNNI)
  for (int t = 0; t < 8; t++) d = _mm512_dpbusd_epi32(d, w[t], _mm512_set1_epi32(quads[t]));
#else
  const __m512i ones = _mm512_set1_epi16(1);
  for (int t = 0; t < 8; t++) {
    const __m512i x = _mm512_set1_epi32(quads[t]);
    __m512i p;
    if constexpr (Q4) {  // weights <= 15: VPMADDUBSW's int16 pair sums cannot saturate
      p = _mm512_maddubs_epi16(w[t], x);
    } else {  // weights up to 255 would: multiply |q - 128| by x carrying q - 128's sign instead
      const __m512i ws = _mm512_xor_si512(w[t], _mm512_set1_epi8(char(0x80)));
      const __m512i xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(ws), _mm512_setzero_si512(), x);
      p = _mm512_maddubs_epi16(_mm512_abs_epi8(ws), xs);
    }
    d = _mm512_add_epi32(d, _mm512_madd_epi16(p, ones));
  }
#endif
  return d;
}

// 255 h + l: the two digits' dot products recombined into <w, n> (qdot.h).
inline __m512i combine_digits(__m512i h, __m512i l) {
  return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(h, 8), h), l);
}

// Sum over the block's 32 k of w x n per column: 255 <w, hi> + <w, lo>.
template <bool Q4>
inline __m512i block_dot(const __m512i w[8], const int8_t* hi, const int8_t* lo) {
  return combine_digits(digit_dot<Q4>(w, hi), digit_dot<Q4>(w, lo));
}

// One block's term added to a row's 16 column sums: scale_w * d_x * <q, n> + offset_w * s_x, in this order of
// roundings. The AMX loop (qdot_amx.h) adds its blocks with this same function, which is what keeps its output
// bit-identical to this loop's.
inline __m512 add_block(__m512 acc, __m512i dot, __m512 scale, __m512 offset, float d, float s) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(d)), acc);
  return _mm512_fmadd_ps(offset, _mm512_set1_ps(s), acc);
}

// 16 columns' scales (or offsets) of one block as float32: stored as float32, or as IEEE halves (cvk.h).
inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 offsets from element i of a group's offsets: stored, or mid * scale (the weight's kMidOffset, qdot.h) when
// it stores none.
template <typename S>
inline __m512 load_offsets(const S* offset, __m512 scale, int64_t i, float mid) {
  return offset != nullptr ? load_scales(offset + i) : _mm512_mul_ps(scale, _mm512_set1_ps(mid));
}

// Whether block_dot returned sum((q - 128) n) for 8-bit weights (the signed detour above) instead of sum(q x);
// the caller adds 128 * sum(n) back through the offset.
#if defined(CVK_VNNI)
constexpr bool kSignedQ8Dot = false;
#else
constexpr bool kSignedQ8Dot = true;
#endif

// out[r][0..16) = sum over blocks j of scale_j * d_rj * <q_j, n_rj> + offset_j * s_rj, for one group of 16
// columns and R rows (qs, scale, offset: the group's part of the weight; S float or uint16_t halves). prefetch:
// ask for the weights kPrefetchBlocks ahead (qdot.h), on the first pass over a group.
template <int R, bool Q4, typename S>
inline void group_dot(const uint8_t* qs, const S* scale, const S* offset, const QRow* xr, int64_t nb, float* out,
                      bool prefetch) {
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  constexpr int64_t block_bytes = Q4 ? 256 : 512;
  for (int64_t j = 0; j < nb; j++) {
    if (prefetch) prefetch_block<Q4>(qs, scale, offset, j);
    __m512i w[8];
    load_block<Q4>(qs + j * block_bytes, w);
    const __m512 a = load_scales(scale + j * 16);
    __m512 b = load_offsets(offset, a, j * 16, kMidOffset<Q4>);
    if constexpr (!Q4 && kSignedQ8Dot) b = _mm512_fmadd_ps(a, _mm512_set1_ps(128.f), b);
    for (int r = 0; r < R; r++) {
      acc[r] = add_block(acc[r], block_dot<Q4>(w, xr[r].hi + j * 32, xr[r].lo + j * 32), a, b, xr[r].d[j], xr[r].s[j]);
    }
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * 16, acc[r]);
}

}  // namespace qdot
}  // namespace cvk
