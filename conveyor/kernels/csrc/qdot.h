// The per-ISA inner loops of the quantized GEMM (gemm_quant.cpp): qdot_avx512.h or qdot_avx2.h, picked by the
// build's CVK_* macro as vec.h picks its V. Both read the same weight and activation layouts (cvk.h's
// CvkQuantWeight; QRow below), so the packing in conveyor/layers/quantized.py is one for every level.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "cvk.h"
#include "level.h"

// The per-block helpers of the group loops (load_block, digit_dot, block_dot): inlined whatever the compiler's
// budget. With the 5-bit loads in, GCC called block_dot<5> out of line, its 8 weight vectors passed through memory:
// the loop ran 1.6x slower than the 8-bit one at 64 rows (perf: 36% of the time in the call).
#define CVK_QDOT_INLINE inline __attribute__((always_inline))

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
// digits; d [KP / 32] the blocks' units; s [KP / 32] = d * sum(n) per block (for the weights' offsets); hs
// [KP / 16] = sum(n) per 16 values, as integers (CVK_Q6's q - 32 per sub-block of 16: <q, n> - 32 sum(n), exact).
struct QRow {
  const int8_t* hi;
  const int8_t* lo;
  const float* d;
  const float* s;
  const int32_t* hs;
};

// CVK_Q6 (cvk.h): bytes a block of 32 k x 16 columns takes (4-bit low parts, then 2-bit high parts), and q's
// middle, subtracted per sub-block of 16 in integers.
constexpr int64_t kQ6BlockBytes = 384;
constexpr int32_t kQ6Mid = 32;

// How far ahead of the block it multiplies a one-pass group_dot asks for the weights, in blocks (4 KB of 4-bit
// weights, 8 KB of 8-bit), into L2. A decode step reads each weight once, in layers of a few hundred KB per
// thread, and between them the loop stops at a barrier: the hardware prefetcher alone ramps up again on every
// layer and falls behind. Asked for here, past the end of a group into the thread's next one, the weights
// stream about 1.6x faster at batch 1 (docs/kernels.md, "Prefetching the weights").
constexpr int64_t kPrefetchBlocks = 16;

// The widths of q the group loops read (qdot_*.h's template argument Bits): 4-bit q (CVK_Q4, two a byte), 5-bit
// (CVK_Q5: CVK_Q4's nibbles plus a plane of fifth bits) and 8-bit (CVK_Q8). Bytes one block of 32 k x 16
// columns takes in each.
template <int Bits>
constexpr int64_t kBlockBytes = Bits == 4 ? 256 : Bits == 5 ? 256 + 64 : 512;
inline int bits_of(int kind) { return kind == CVK_Q4 ? 4 : kind == CVK_Q5 ? 5 : 8; }

// A weight without stored offsets (CvkQuantWeight.offset NULL: Q8_0, Q4_0, Q5_0, int8) has offset = mid * scale,
// q's middle: -128 for 8-bit q (signed values stored as q + 128), -16 for 5-bit, -8 for 4-bit. The kernels
// compute it (exact in float32: a power of two times the scale), so the weight stream carries no offsets.
template <int Bits>
constexpr float kMidOffset = Bits == 4 ? -8.f : Bits == 5 ? -16.f : -128.f;
inline float mid_offset(int kind) {
  const int bits = bits_of(kind);
  return bits == 4 ? kMidOffset<4> : bits == 5 ? kMidOffset<5> : kMidOffset<8>;
}

// Prefetches block j + kPrefetchBlocks of a group's weights and its scales and offsets (none when NULL). The
// address may lie past the weight's end (a prefetch never faults), so it is computed as an integer, not a pointer.
template <int Bits, typename S>
inline void prefetch_block(const uint8_t* qs, const S* scale, const S* offset, int64_t j) {
  constexpr int64_t block_bytes = kBlockBytes<Bits>;
  const int64_t ahead = j + kPrefetchBlocks;
  const uintptr_t q = reinterpret_cast<uintptr_t>(qs) + uintptr_t(ahead * block_bytes);
  for (int64_t b = 0; b < block_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(q + b), _MM_HINT_T1);
  const uintptr_t step = uintptr_t(ahead * 16 * int64_t(sizeof(S)));  // 16 columns' scales per block
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(scale) + step), _MM_HINT_T1);
  if (offset != nullptr)
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(offset) + step), _MM_HINT_T1);
}

// prefetch_block for CVK_Q6: block j + kPrefetchBlocks's 384 bytes and its 32 sub-scales (the super-scales,
// 32 bytes per 8 blocks, stay in cache).
inline void prefetch_block_q6(const uint8_t* qs, const int8_t* sub, int64_t j) {
  const int64_t ahead = j + kPrefetchBlocks;
  const uintptr_t q = reinterpret_cast<uintptr_t>(qs) + uintptr_t(ahead * kQ6BlockBytes);
  for (int64_t b = 0; b < kQ6BlockBytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(q + b), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(sub) + uintptr_t(ahead * 32)), _MM_HINT_T1);
}

}  // namespace cvk

#if CVK_AVX512_LANES
#include "qdot_avx512.h"
#else
#include "qdot_avx2.h"
#endif
