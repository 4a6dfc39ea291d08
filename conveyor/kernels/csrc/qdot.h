// The per-ISA inner loops of the quantized GEMM (gemm_quant.cpp): qdot_avx512.h or qdot_avx2.h, picked by the
// build's CVK_* macro as vec.h picks its V. Both read the same weight and activation layouts (cvk.h's
// CvkQuantWeight; QRow below), so the packing in conveyor/layers/quantized.py is one for every level.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace cvk {

// Activations are quantized per block of 32 to integers n in [-kActMax, kActMax] (unit d = max |x| / kActMax,
// round half to even): 15 bits, not llama.cpp's 8, so that the activations add next to no error to the
// weights' (8-bit ones moved the logprob of SmolLM2's first reply token by 0.44 and changed its greedy
// answer; docs/kernels.md). n is held as two int8 digits in base 255, n = 255 hi + lo with hi = round(n / 255)
// (255 is odd: never a tie) and lo = n - 255 hi, both within [-127, 127] (the sign tricks below cannot take
// -128), so every dot product is 255 <w, hi> + <w, lo> on the same 8-bit instructions, and it fits int32
// (32 x 255 x kActMax < 2^31).
constexpr int kDigit = 255;
constexpr int kActMax = 127 * kDigit;

// One activation row quantized (gemm_quant.cpp's quantize_row writes it into scratch): hi [KP] and lo [KP] the
// digits; d [KP / 32] the blocks' units; s [KP / 32] = d * sum(n) per block (for the weights' offsets).
struct QRow {
  const int8_t* hi;
  const int8_t* lo;
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
