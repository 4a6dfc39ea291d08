// The vector level this library is built for: the build (cpu_features.LEVEL_FLAGS) defines exactly one of
// CVK_AVX512BF16, CVK_AVX512, CVK_AVX2. CVK_AVX512_LANES is 1 on the AVX-512 levels (16 float lanes) and 0 on AVX2
// (8); vec.h and qdot.h pick their per-level header by it.
#pragma once

#if defined(CVK_AVX512) || defined(CVK_AVX512BF16)
#define CVK_AVX512_LANES 1
#elif defined(CVK_AVX2)
#define CVK_AVX512_LANES 0
#else
#error "compile with one of CVK_AVX512BF16, CVK_AVX512, CVK_AVX2"
#endif
