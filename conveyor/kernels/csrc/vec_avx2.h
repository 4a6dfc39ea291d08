// The float vector type V of the AVX2 level (CVK_AVX2: AVX2 + FMA): 8 lanes. Included by vec.h only.
#pragma once

namespace cvk {

constexpr int W = 8;
struct V {
  __m256 v;
  static V zero() { return {_mm256_setzero_ps()}; }
  static V set1(float x) { return {_mm256_set1_ps(x)}; }
  static V load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static V load(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  // W int8 values as floats (the int8 KV cache's rows)
  static V load(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  // W int32 values as floats (W8A8's integer sums)
  static V load_i32(const int32_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  // lanes rounded half-to-even (the default MXCSR mode) to int32, saturated to int8
  void store_i8(int8_t* p) const {
    const __m256i i = _mm256_cvtps_epi32(v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(uint16_t* p) const {
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  friend V operator+(V a, V b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend V operator-(V a, V b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend V operator*(V a, V b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend V operator/(V a, V b) { return {_mm256_div_ps(a.v, b.v)}; }
  static V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static V max(V a, V b) { return {_mm256_max_ps(a.v, b.v)}; }
  static bool any_ne(V a, V b) { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_NEQ_UQ)) != 0; }
  static int first_eq(V a, V b) {  // the first lane where a == b, or -1
    const unsigned m = unsigned(_mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ)));
    return m ? __builtin_ctz(m) : -1;
  }
  static bool any_nan(V a) { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)) != 0; }
  static V rcp(V a) {  // 1 / a to ~22 bits: a 12-bit estimate and one Newton step
    __m256 r = _mm256_rcp_ps(a.v);
    return {_mm256_mul_ps(r, _mm256_fnmadd_ps(a.v, r, _mm256_set1_ps(2.0f)))};
  }
  static V blend_gt(V a, V b, V if_gt, V otherwise) {
    return {_mm256_blendv_ps(otherwise.v, if_gt.v, _mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ))};
  }
  static V hsum_lanes(const V* a) {  // lane j = sum of the lanes of a[j], for 8 vectors
    __m256 t0 = _mm256_hadd_ps(a[0].v, a[1].v), t1 = _mm256_hadd_ps(a[2].v, a[3].v);
    __m256 t2 = _mm256_hadd_ps(a[4].v, a[5].v), t3 = _mm256_hadd_ps(a[6].v, a[7].v);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return {_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31))};
  }
  // lanes [0, n) of p, the others 0; store_n writes lanes [0, n) only (n may be <= 0 or >= W)
  static __m256i lanes(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
  static V load_n(const float* p, int n) { return {_mm256_maskload_ps(p, lanes(n))}; }
  void store_n(float* p, int n) const { _mm256_maskstore_ps(p, lanes(n), v); }
  // W pairs of bfloat16 (x[2i], x[2i + 1]) as two float vectors: even = the x[2i], odd = the x[2i + 1]
  static void load_bf16_pairs(const uint16_t* p, V& even, V& odd) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = {_mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16))};
    odd = {_mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xffff0000u))))};
  }
  float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  float hmax() const {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static V exp(V x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 tiny = _mm256_cmp_ps(x.v, lo, _CMP_LT_OQ);
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x.v, lo), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    const __m256 p = exp_poly(V{r}).v;
    // 2^n: n + 127 in the exponent bits (n is in [-126, 127] after the clamps above).
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return {_mm256_andnot_ps(tiny, y)};
  }
};

}  // namespace cvk
