// The int8 KV cache's decode scores as integer dot products: each query row (rotated and scaled as
// load_query_row leaves it) is quantized once per item to 16-bit integers, and its score against a key is
// sum_d q[d] * k[d] over the key's int8 values straight from the cache, in int32 (VPMADDWD, or VPDPWSSD with
// AVX512_VNNI), times the query's and the key's scales. Widening every key row to float32 first and running the
// float loop (the path before this) took more instructions per key than the float32 cache's own loop, so the
// int8 cache's 3.8x fewer bytes did not show as time. The query keeps 16 bits (its step max |q| / 32767, far
// below the key's 8-bit step), so the scores are the dequantized keys' to float32 rounding, not a second
// quantization's error (a VPDPBUSD of 8-bit queries would be; docs/kv-cache.md).
#pragma once

#include "attention_common.h"

namespace cvk {

// A query row of D values as int16 (zero past D up to the next 32) and its scale.
struct QueryI16 {
  alignas(64) int16_t q[MAX_D + 32];
  float scale;
};

inline void quantize_query(const float* y, int D, QueryI16& out) {
  float amax = 0.f;
  for (int d = 0; d < D; d++) amax = std::max(amax, fabsf(y[d]));
  out.scale = amax / 32767.f;
  const float inv = amax > 0.f ? 32767.f / amax : 0.f;
  for (int d = 0; d < D; d++) out.q[d] = int16_t(lrintf(y[d] * inv));
  for (int d = D; d < D + 32; d++) out.q[d] = 0;
}

// W lanes whose sum is sum_d k[d] * q[d] (exact in int32, then each lane to float32), D a multiple of W.
#if CVK_AVX512_LANES
inline V int8_dot_lanes(const int8_t* k, const QueryI16& q, int D) {
  __m512i acc = _mm512_setzero_si512();
  for (int d = 0; d < D; d += 32) {
    const __mmask32 m = D - d >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << (D - d)) - 1);
    const __m512i kw = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, k + d));
    const __m512i qw = _mm512_load_si512(q.q + d);
#if defined(CVK_VNNI)
    acc = _mm512_dpwssd_epi32(acc, kw, qw);
#else
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(kw, qw));
#endif
  }
  return {_mm512_cvtepi32_ps(acc)};
}
#else
inline V int8_dot_lanes(const int8_t* k, const QueryI16& q, int D) {
  __m256i acc = _mm256_setzero_si256();
  int d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m256i kw = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + d)));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(kw, _mm256_load_si256(reinterpret_cast<const __m256i*>(q.q + d))));
  }
  if (d < D) {  // 8 values left (AVX2 serves multiples of 8); q is zero past D
    const __m256i kw = _mm256_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(k + d)));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(kw, _mm256_load_si256(reinterpret_cast<const __m256i*>(q.q + d))));
  }
  return {_mm256_cvtepi32_ps(acc)};
}
#endif

}  // namespace cvk
