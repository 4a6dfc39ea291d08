// UnitPrefetch: the skinny GEMMs' (gemm_skinny.cpp float32, gemm_bf16dot.cpp bfloat16) stream of a thread's
// next unit of packed weights into L2 while the current unit's row tiles compute.
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace cvk {

// Streams the weights of a thread's next unit (its NB blocks: one contiguous run of lines) into L2 while the
// current unit computes, a few lines per k step at the rate that spreads the whole run over the unit's passes
// (row tiles x K steps). Asking for the next chunk of the same unit during the first tile's pass only, as this
// loop did before, bunched the requests into a quarter of the time at 32 rows, and the later passes, served
// from L1, left memory idle; spread over every pass, the GEMM over DRAM-resident weights took 10-23% less time
// at 16-86 rows (docs/kernels.md). Into L1 (T0) it evicted the chunk the later tiles re-read (9 rows 22% slower).
struct UnitPrefetch {
  const char* next = nullptr;  // null: the thread has no next unit
  int64_t line = 0, lines = 0;
  uint32_t acc = 0, rate = 0;  // lines per k step, 16.16 fixed point
  inline void step() {
    for (acc += rate; acc >= 65536u; acc -= 65536u, line++)
      if (line < lines) _mm_prefetch(next + line * 64, _MM_HINT_T1);
  }
};

}  // namespace cvk
