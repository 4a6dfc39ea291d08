// The per-ISA inner loops of the quantized GEMM (gemm_quant.cpp): qdot_avx512.h or qdot_avx2.h, picked by the
// build's CVK_* macro as vec.h picks its V. Both read the same weight and activation layouts (cvk.h's
// CvkQuantWeight; QRow below), so the packing in conveyor/layers/quantized.py is one for every level.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace cvk {

// One activation row quantized per block of 32 (gemm_quant.cpp's quantize_row writes it into scratch):
//   q [KP] int8; d [KP / 32] the blocks' scales; s [KP / 32] = d * sum(q) per block (for the weights' offsets).
struct QRow {
  const int8_t* q;
  const float* d;
  const float* s;
};

}  // namespace cvk

#if defined(CVK_AVX512) || defined(CVK_AVX512BF16)
#include "qdot_avx512.h"
#elif defined(CVK_AVX2)
#include "qdot_avx2.h"
#else
#error "compile with one of CVK_AVX512BF16, CVK_AVX512, CVK_AVX2"
#endif
