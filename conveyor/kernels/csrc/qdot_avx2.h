// The integer dot products of the quantized GEMM (gemm_quant.cpp) at 256 bits: a 64-byte quad of 16 columns x
// 4 k is two halves of 8 columns; VPMADDUBSW + VPMADDWD against 4 broadcast activation bytes (AVX2 has no VNNI).
// Included by qdot.h only.
#pragma once

namespace cvk {
namespace qdot {

constexpr int kRows = 2;  // 16 registers: 8 weight vectors, 2 x 2 accumulators and temporaries

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

// 8-bit signed lanes of 32 int32 values (|v| <= 127), in order: the packs interleave 128-bit lanes; the permute
// puts the values back in order.
inline void store_i8(const __m256i v[4], int8_t* out) {
  const __m256i p16a = _mm256_packs_epi32(v[0], v[1]), p16b = _mm256_packs_epi32(v[2], v[3]);
  const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                 _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), p8);
}

// One block of 32 floats -> its integers n (qdot.h) as digits, its unit d (max |x| / kActMax), d * sum(n), and
// sum(n) of each half (hs[0], hs[1]).
inline void quantize_block(const float* x, int8_t* hi, int8_t* lo, float* d, float* s, int32_t* hs) {
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float id = amax > 0.f ? float(kActMax) / amax : 0.f;
  __m256i n[4], h[4], l[4];
  for (int k = 0; k < 4; k++) {
    n[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(id)));
    h[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(n[k]), _mm256_set1_ps(1.f / kDigit)));
    l[k] = _mm256_sub_epi32(n[k], _mm256_sub_epi32(_mm256_slli_epi32(h[k], 8), h[k]));
  }
  store_i8(h, hi);
  store_i8(l, lo);
  *d = amax / float(kActMax);
  hs[0] = hsum_i32(_mm256_add_epi32(n[0], n[1]));
  hs[1] = hsum_i32(_mm256_add_epi32(n[2], n[3]));
  *s = *d * float(hs[0] + hs[1]);
}

// Half h (columns 8h .. 8h + 7) of the block's 8 quads, as unsigned bytes; 5-bit q's fifth bits from the plane
// after the nibbles as qdot_avx512.h's load_block moves them (shift bit t to bit 4, mask, OR).
template <int Bits>
CVK_QDOT_INLINE void load_half(const uint8_t* qs, int h, __m256i w[8]) {
  if constexpr (Bits < 8) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int u = 0; u < 4; u++) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + u * 64 + h * 32));
      w[2 * u] = _mm256_and_si256(v, m4);
      w[2 * u + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    if constexpr (Bits == 5) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 256 + h * 32));
      const __m256i bit4 = _mm256_set1_epi8(0x10);
      for (int t = 0; t < 8; t++) {
        const __m256i moved = t <= 4 ? _mm256_slli_epi16(hb, 4 - t) : _mm256_srli_epi16(hb, t - 4);
        w[t] = _mm256_or_si256(w[t], _mm256_and_si256(moved, bit4));
      }
    }
  } else {
    for (int t = 0; t < 8; t++) w[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + t * 64 + h * 32));
  }
}

// A group's nb 5-bit blocks as 8-bit ones (qdot_avx512.h's expand_q5_group).
template <typename S>
inline void expand_q5_group(const uint8_t* qs, const S* scale, const S* offset, int64_t nb, uint8_t* out) {
  for (int64_t j = 0; j < nb; j++) {
    prefetch_block<5>(qs, scale, offset, j);
    for (int h = 0; h < 2; h++) {
      __m256i w[8];
      load_half<5>(qs + j * kBlockBytes<5>, h, w);
      for (int t = 0; t < 8; t++) _mm256_store_si256(reinterpret_cast<__m256i*>(out + j * 512 + t * 64 + h * 32), w[t]);
    }
  }
}

// Sum over the block's 32 k per column of w x one digit of x: q x for 4-bit weights; (q - 128) x for 8-bit
// ones, whose q up to 255 would saturate VPMADDUBSW's int16 pair sums (|q - 128| against x carrying its sign
// instead; the caller adds 128 * sum(n) back through the offset).
template <int Bits>
CVK_QDOT_INLINE __m256i digit_dot(const __m256i w[8], const int8_t* xq) {
  int32_t quads[8];
  memcpy(quads, xq, 32);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i d = _mm256_setzero_si256();
  for (int t = 0; t < 8; t++) {
    const __m256i x = _mm256_set1_epi32(quads[t]);
    __m256i p;
    if constexpr (Bits < 8) {  // weights <= 31: the int16 pair sums cannot saturate
      p = _mm256_maddubs_epi16(w[t], x);
    } else {
      const __m256i ws = _mm256_xor_si256(w[t], _mm256_set1_epi8(char(0x80)));
      p = _mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(x, ws));
    }
    d = _mm256_add_epi32(d, _mm256_madd_epi16(p, ones));
  }
  return d;
}

// CVK_Q6: half h (columns 8h .. 8h + 7) of the block's 8 quads as bytes q in [0, 63]: the low 4 bits as
// load_half<true> reads them, the high 2 from the 128 bytes after them (cvk.h).
inline void load_half_q6(const uint8_t* qs, int h, __m256i w[8]) {
  load_half<4>(qs, h, w);
  const __m256i m2 = _mm256_set1_epi8(0x03);
  for (int v = 0; v < 2; v++) {
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 256 + v * 64 + h * 32));
    for (int t = 0; t < 4; t++) {
      const __m256i bits = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * t), m2);
      w[4 * v + t] = _mm256_or_si256(w[4 * v + t], _mm256_slli_epi16(bits, 4));
    }
  }
}

// Per column, the sums over the block's first 16 k (quads 0-3) and its last 16 (quads 4-7) of w x one digit of
// x, for weights below 64 (VPMADDUBSW's pair sums cannot saturate).
inline void digit_dot_halves(const __m256i w[8], const int8_t* xq, __m256i& d0, __m256i& d1) {
  int32_t quads[8];
  memcpy(quads, xq, 32);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i d[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int t = 0; t < 8; t++) {
    const __m256i p = _mm256_maddubs_epi16(w[t], _mm256_set1_epi32(quads[t]));
    d[t / 4] = _mm256_add_epi32(d[t / 4], _mm256_madd_epi16(p, ones));
  }
  d0 = d[0];
  d1 = d[1];
}

CVK_QDOT_INLINE __m256i combine_digits(__m256i h, __m256i l) {
  return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(h, 8), h), l);
}

// Sum over the block's 32 k of w x n per column: 255 <w, hi> + <w, lo>.
template <int Bits>
CVK_QDOT_INLINE __m256i block_dot(const __m256i w[8], const int8_t* hi, const int8_t* lo) {
  const __m256i h = digit_dot<Bits>(w, hi);
  return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(h, 8), h), digit_dot<Bits>(w, lo));
}

constexpr bool kSignedQ8Dot = true;

// 8 columns' scales (or offsets) of one block as float32: stored as float32, or as IEEE halves (cvk.h).
inline __m256 load_scales(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scales(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 offsets from element i of a group's offsets: stored, or mid * scale (the weight's kMidOffset, qdot.h) when
// it stores none.
template <typename S>
inline __m256 load_offsets(const S* offset, __m256 scale, int64_t i, float mid) {
  return offset != nullptr ? load_scales(offset + i) : _mm256_mul_ps(scale, _mm256_set1_ps(mid));
}

// 8 columns' K-quant sub-scales (or minimums) of one block (CVK_SCALE_KQUANT, cvk.h), bytes, as float32.
inline __m256 load_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Block j's 8 scales a and offsets b of column half h (as qdot_avx512.h's block_scales).
template <int Bits, typename S>
inline void block_scales(const S* scale, const S* offset, const uint16_t* super, int64_t j, int h, __m256& ds,
                         __m256& ms, __m256& a, __m256& b) {
  if constexpr (std::is_same_v<S, uint8_t>) {
    if (j % 8 == 0) {
      ds = load_scales(super + (j / 8) * 32 + h * 8);
      ms = _mm256_xor_ps(load_scales(super + (j / 8) * 32 + 16 + h * 8), _mm256_set1_ps(-0.f));
    }
    a = _mm256_mul_ps(ds, load_u8(scale + j * 16 + h * 8));
    b = _mm256_mul_ps(ms, load_u8(offset + j * 16 + h * 8));
  } else {
    a = load_scales(scale + j * 16 + h * 8);
    b = load_offsets(offset, a, j * 16 + h * 8, kMidOffset<Bits>);
  }
}

// out[r][0..16) = sum over blocks j of scale_j * d_rj * <q_j, n_rj> + offset_j * s_rj, for one group of 16
// columns and R rows (S: float, uint16_t halves or uint8_t K-quant sub-scales, as the weight stores its scales;
// super: their super-scales). prefetch: ask for the
// weights kPrefetchBlocks ahead (qdot.h), on the first pass over a group (the first half's: the second reads
// the same lines from cache). Expanded: qs holds Bits-bit q laid out as 8-bit blocks (expand_q5_group).
template <int R, int Bits, typename S, bool Expanded = false>
inline void group_dot(const uint8_t* qs, const S* scale, const S* offset, const uint16_t* super, const QRow* xr,
                      int64_t nb, float* out, bool prefetch) {
  constexpr int Layout = Expanded ? 8 : Bits;
  constexpr int64_t block_bytes = kBlockBytes<Layout>;
  for (int h = 0; h < 2; h++) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    __m256 ds = _mm256_setzero_ps(), ms = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
      if (prefetch && h == 0) prefetch_block<Layout>(qs, scale, offset, j);
      __m256i w[8];
      load_half<Layout>(qs + j * block_bytes, h, w);
      __m256 a, b;
      block_scales<Bits>(scale, offset, super, j, h, ds, ms, a, b);
      if constexpr (Bits == 8) b = _mm256_fmadd_ps(a, _mm256_set1_ps(128.f), b);
      for (int r = 0; r < R; r++) {
        const __m256i d = block_dot<Bits>(w, xr[r].hi + j * 32, xr[r].lo + j * 32);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(a, _mm256_set1_ps(xr[r].d[j])), acc[r]);
        acc[r] = _mm256_fmadd_ps(b, _mm256_set1_ps(xr[r].s[j]), acc[r]);
      }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * 16 + h * 8, acc[r]);
  }
}

// group_dot for a CVK_Q6 weight (cvk.h): sub int8 [nb][2][16] its sub-scales, super f16 [nb / 8][16]. Per
// sub-block of 16 k: acc += (super * sub * d_x) * (<q, n> - 32 sum(n)), the bracket in integers.
template <int R>
inline void group_dot_q6(const uint8_t* qs, const int8_t* sub, const uint16_t* super, const QRow* xr, int64_t nb,
                         float* out, bool prefetch) {
  for (int h = 0; h < 2; h++) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    __m256 ds = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
      if (prefetch && h == 0) prefetch_block_q6(qs, sub, j);
      if (j % 8 == 0) ds = load_scales(super + (j / 8) * 16 + h * 8);
      __m256i w[8];
      load_half_q6(qs + j * kQ6BlockBytes, h, w);
      const int8_t* sj = sub + j * 32 + h * 8;
      const __m256 a0 = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sj)))));
      const __m256 a1 = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sj + 16)))));
      for (int r = 0; r < R; r++) {
        __m256i h0, h1, l0, l1;
        digit_dot_halves(w, xr[r].hi + j * 32, h0, h1);
        digit_dot_halves(w, xr[r].lo + j * 32, l0, l1);
        const __m256i dot0 = _mm256_sub_epi32(combine_digits(h0, l0), _mm256_set1_epi32(kQ6Mid * xr[r].hs[2 * j]));
        const __m256i dot1 =
            _mm256_sub_epi32(combine_digits(h1, l1), _mm256_set1_epi32(kQ6Mid * xr[r].hs[2 * j + 1]));
        const __m256 d = _mm256_set1_ps(xr[r].d[j]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), _mm256_mul_ps(a0, d), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), _mm256_mul_ps(a1, d), acc[r]);
      }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * 16 + h * 8, acc[r]);
  }
}

// W8A8 (CVK_W8A8): no loop at this width (gemm_w8a8.cpp refuses with CVK_ERR_UNSUPPORTED; the caller runs
// oneDNN's s8s8s32 GEMM and the native epilogue instead). The declaration keeps the shared code compiling.
constexpr bool kW8a8Dot = false;
constexpr int kW8a8Rows = 1;
template <int R>
inline void w8a8_group_dot(const uint8_t*, const uint8_t*, const int8_t* const*, int64_t, int32_t* out_a,
                           int32_t* out_b, bool) {
  for (int i = 0; i < R * 16; i++) out_a[i] = out_b[i] = 0;
}

}  // namespace qdot
}  // namespace cvk
