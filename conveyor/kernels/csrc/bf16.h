// Scalar float32 <-> bfloat16 (stored as uint16_t): exact widening, and rounding to nearest even as torch does
// (NaN stays a quiet NaN). The vector forms are V::load / V::store (vec_*.h).
#pragma once

#include <stdint.h>
#include <string.h>

namespace cvk {

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline void from_f32(float x, float* p) { *p = x; }
inline void from_f32(float x, uint16_t* p) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *p = 0x7fc0;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = uint16_t(u >> 16);
}

}  // namespace cvk
