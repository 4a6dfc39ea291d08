// The vector helpers every kernel is written in: V, a float vector of the compiled width W, with the few
// operations the kernels need. Each instruction-set level has its own file (vec_avx512.h, vec_avx2.h) and this
// header picks one by the CVK_* macro its build defines (kernels/cpu_features.py gives the flags), so a kernel
// body is written once, in V, and ISA differences stay inside the helpers.
//   kBf16Dot: VDPBF16PS (bfloat16 dot products) is there (CVK_AVX512BF16); the kernels that use it directly
//   (attention_bf16.h, gemm_skinny.cpp's bfloat16 tile, the AMX files) are compiled only for that level.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "level.h"

namespace cvk {

// exp(r) for |r| <= ln(2)/2: the Cephes polynomial, shared by every vector width (V::exp reduces x to r).
template <class Vec>
inline Vec exp_poly(Vec r) {
  Vec p = Vec::set1(1.9875691500E-4f);
  p = Vec::fma(p, r, Vec::set1(1.3981999507E-3f));
  p = Vec::fma(p, r, Vec::set1(8.3334519073E-3f));
  p = Vec::fma(p, r, Vec::set1(4.1665795894E-2f));
  p = Vec::fma(p, r, Vec::set1(1.6666665459E-1f));
  p = Vec::fma(p, r, Vec::set1(5.0000001201E-1f));
  return Vec::fma(p, r * r, r + Vec::set1(1.0f));
}

}  // namespace cvk

#if CVK_AVX512_LANES
#include "vec_avx512.h"
#else
#include "vec_avx2.h"
#endif

namespace cvk {
#if defined(CVK_AVX512BF16)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif
}  // namespace cvk
