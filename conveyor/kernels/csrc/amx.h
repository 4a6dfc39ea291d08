// AMX tile basics shared by the AMX attention (attention_amx.h) and GEMM (gemm_amx.cpp). AMX code is compiled
// only at the avx512bf16 level (kAmx) and runs only where Linux grants this process the tile state
// (amx_request_permission, from cvk_amx_init); elsewhere these are stubs that are never reached.
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "vec.h"

namespace cvk {

constexpr bool kAmx = kBf16Dot;  // compiled in at the avx512bf16 level; used only once granted

#if defined(CVK_AVX512BF16)
// Whether cvk_amx_init obtained the tile state for this process: the switches below can only be on if it did.
inline bool g_amx_granted = false;
// The quantized GEMM's integer dot products on AMX-INT8 tiles (qdot_amx.h) for steps of at least this many rows
// (0: never), for 4-bit and for 8-bit weights: set where the CPU has AMX-INT8 (the Python side checks its
// flags) by cvk_set_amx_qdot.
inline int64_t g_amx_qdot_min_rows_q4 = 0;
inline int64_t g_amx_qdot_min_rows_q8 = 0;
// Prefill attention's QK^T on AMX tiles (bfloat16): set by cvk_amx_init once Linux grants the tile state, and
// switchable (cvk_set_amx_attention) so tests and benchmarks can run both paths.
inline bool g_amx_attention = false;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

__attribute__((target("amx-tile,amx-bf16"))) inline void amx_configure(int rows0, int rows1) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  const int r1 = rows1 > 0 ? rows1 : 1;
  const int rows[8] = {rows0, r1, 16, 16, rows0, rows0, r1, r1};
  for (int t = 0; t < 8; t++) {
    cfg.rows[t] = uint8_t(rows[t]);
    cfg.colsb[t] = 64;
  }
  // GCC does not count LDTILECFG as reading the whole 64 bytes: without this barrier it dropped the rows and
  // colsb stores of an out-of-line copy of this function (palette 1, no tile configured: SIGILL at first use).
  __asm__ __volatile__("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile,amx-bf16"))) inline void amx_release() { _tile_release(); }

// Ask Linux for the AMX tile state (once per process; oneDNN asks the same). True: AMX usable.
inline bool amx_request_permission() {
#if defined(__linux__)
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}
#else
inline bool g_amx_granted = false;
inline int64_t g_amx_qdot_min_rows_q4 = 0;
inline int64_t g_amx_qdot_min_rows_q8 = 0;
inline bool g_amx_attention = false;
inline void amx_configure(int, int) { abort(); }
inline void amx_release() { abort(); }
inline bool amx_request_permission() { return false; }
#endif

}  // namespace cvk
