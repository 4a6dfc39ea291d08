// The float vector type V of the AVX-512 levels (CVK_AVX512, CVK_AVX512BF16): 16 lanes. Included by vec.h only.
#pragma once

namespace cvk {

constexpr int W = 16;
struct V {
  __m512 v;
  static V zero() { return {_mm512_setzero_ps()}; }
  static V set1(float x) { return {_mm512_set1_ps(x)}; }
  static V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V load(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  // W int8 values as floats (the int8 KV cache's rows)
  static V load(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  // W int32 values as floats (W8A8's integer sums)
  static V load_i32(const int32_t* p) { return {_mm512_cvtepi32_ps(_mm512_loadu_si512(p))}; }
  // lanes rounded half-to-even (the default MXCSR mode) to int32, saturated to int8
  void store_i8(int8_t* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(uint16_t* p) const {
#if defined(CVK_AVX512BF16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
    // Round to nearest even, as torch does; NaN stays a quiet NaN.
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
  }
  friend V operator+(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend V operator-(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend V operator*(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend V operator/(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
  static V fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
  static V max(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
  static bool any_ne(V a, V b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_NEQ_UQ) != 0; }
  static int first_eq(V a, V b) {  // the first lane where a == b, or -1
    const unsigned m = _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ);
    return m ? __builtin_ctz(m) : -1;
  }
  static bool any_nan(V a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q) != 0; }
  static V rcp(V a) {  // 1 / a to ~23 bits: a 14-bit estimate and one Newton step (no slow division)
    __m512 r = _mm512_rcp14_ps(a.v);
    return {_mm512_mul_ps(r, _mm512_fnmadd_ps(a.v, r, _mm512_set1_ps(2.0f)))};
  }
  static V blend_gt(V a, V b, V if_gt, V otherwise) {  // a > b ? if_gt : otherwise, per lane
    return {_mm512_mask_mov_ps(otherwise.v, _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ), if_gt.v)};
  }
  // One vector whose lane j is the sum of the lanes of a[j], for W vectors (a transpose-add tree: ~45
  // instructions for 16 sums instead of 16 separate horizontal reductions).
  static V hsum_lanes(const V* a) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
      t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i].v, a[2 * i + 1].v), _mm512_unpackhi_ps(a[2 * i].v, a[2 * i + 1].v));
    for (int i = 0; i < 4; i++) {
      __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
      u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // u[i]: in each 128-bit lane, partial sums of vectors 4i..4i+3; now add the four 128-bit lanes.
    __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return {_mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xdd))};
  }
  // lanes [0, n) of p, the others 0; store_n writes lanes [0, n) only (n may be <= 0 or >= W)
  static __mmask16 lanes(int n) { return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1); }
  static V load_n(const float* p, int n) { return {_mm512_maskz_loadu_ps(lanes(n), p)}; }
  void store_n(float* p, int n) const { _mm512_mask_storeu_ps(p, lanes(n), v); }
  // W pairs of bfloat16 (x[2i], x[2i + 1]) as two float vectors: even = the x[2i], odd = the x[2i + 1]
  static void load_bf16_pairs(const uint16_t* p, V& even, V& odd) {
    const __m512i pairs = _mm512_loadu_si512(p);
    even = {_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16))};
    odd = {_mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int(0xffff0000u))))};
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float hmax() const { return _mm512_reduce_max_ps(v); }
  // exp(x) for x <= 88; 0 for x < -87 (so exp(-inf) == 0 exactly: masked scores contribute nothing).
  static V exp(V x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x.v, lo, _CMP_LT_OQ);
    __m512 xc = _mm512_min_ps(_mm512_max_ps(x.v, lo), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    const __m512 p = exp_poly(V{r}).v;
    return {_mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n))};
  }
};

}  // namespace cvk
