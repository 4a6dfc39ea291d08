// The quantized GEMM's integer dot products on AMX-INT8 tiles (gemm_quant.cpp takes this path for steps of at
// least g_amx_qdot_min_rows_q4 / _q8 rows: AMX_QDOT_MIN_ROWS / _Q8 by default, where the CPU has AMX-INT8 and
// Linux granted the tile state). Compiled at the avx512bf16 level only; below it the stubs at the end are never
// reached.
//
// Why it computes exactly what qdot_avx512.h computes: the weights' packed block (cvk.h: 8 quads of k, each
// 16 columns x 4 consecutive k) is, as it lies, a B tile of TDPBSUD (8 rows of 64 bytes = K/4 rows of 16
// columns x 4 k), and a block of 8 activation rows' hi digits, then their lo digits, is an A tile (16 rows of 32
// bytes). So one TDPBSUD gives <q_w, hi> and <q_w, lo> for 8 rows x 16 columns of one block, in int32 without
// saturation as VPDPBUSD does, and the epilogue then applies the block's scales with group_dot's own add_block
// (qdot_avx512.h). The result is bit-identical to the VNNI path: a step of 5 rows (speculative
// verification) and one of 1 row compute the same numbers. The scales change every 32 k, so every block's tile
// results go through memory (as llama.cpp's AMX kernels do); that epilogue and the one 16-row TDPBSUD per 8 rows
// are the time.
#pragma once

#include "amx.h"
#include "qdot.h"

namespace cvk {
namespace qdot {

constexpr int kAmxRows = 8;  // activation rows per tile pass: an A tile holds their two digits

#if defined(CVK_AVX512BF16)
static_assert(!kSignedQ8Dot, "the AMX path reads unsigned 8-bit weights as the VNNI path does");

// Tiles, two sets alternating by block parity, so that a tile is never reloaded while products issued for the
// block before may still read it (tile registers are not renamed): 0, 1 = A, a block of 8 activation rows' hi
// digits then their lo digits (laid so by pack_activations); 2, 3 = B, the block of a column group's weights
// (8 rows of 64 bytes); 4, 5 = C, the 16 x 16 int32 products (<q, hi> of the 8 rows, then <q, lo>). A block's
// results are stored after the next block's products were issued. (Measured on one thread, 256 rows x 576 x
// 3072, Q4_1: one set of tiles 2.86 ms, two 2.80; what mattered was the sums in registers, R a constant, and
// the rows' units laid beside their digits: 4.0 -> 2.9 ms.)
__attribute__((target("amx-tile,amx-int8"))) inline void amx_configure_qdot() {
  TileConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  const int tile_rows[6] = {16, 16, 8, 8, 16, 16};
  const int tile_bytes[6] = {32, 32, 64, 64, 64, 64};
  for (int t = 0; t < 6; t++) {
    cfg.rows[t] = uint8_t(tile_rows[t]);
    cfg.colsb[t] = uint16_t(tile_bytes[t]);
  }
  __asm__ __volatile__("" : : "m"(cfg) : "memory");  // see amx_configure: LDTILECFG reads all 64 bytes
  _tile_loadconfig(&cfg);
}

// A group's 4-bit blocks (256 bytes each, cvk.h's CVK_Q4) as 8-bit ones (512 bytes: the CVK_Q8 order), so
// they load as B tiles. This is the pass that streams the group from memory, so it asks for the weights (and
// the group's scales and offsets) ahead as group_dot does (prefetch_block, qdot.h).
template <typename S>
inline void unpack_q4_group(const uint8_t* qs, const S* scale, const S* offset, int64_t nb, uint8_t* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t j = 0; j < nb; j++) {
    prefetch_block<4>(qs, scale, offset, j);
    for (int u = 0; u < 4; u++) {
      const __m512i v = _mm512_loadu_si512(qs + j * 256 + u * 64);
      _mm512_store_si512(out + j * 512 + (2 * u) * 64, _mm512_and_si512(v, m4));
      _mm512_store_si512(out + j * 512 + (2 * u + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
    }
  }
}

// Up to kAmxRows quantized activation rows (QRows rb bytes apart, KP digits each) as the AMX loop reads them:
// per block j, `digits` + 512 j holds the rows' hi digits (32 bytes a row) then their lo digits, rows past
// `rows` zero (an A tile); `units` + 16 j their d then their s, so the epilogue broadcasts each from one
// running pointer.
inline void pack_activations(const char* xq, int64_t rb, int64_t KP, int rows, int8_t* digits, float* units) {
  const int64_t nb = KP / 32;
  if (rows < kAmxRows) {
    memset(digits, 0, nb * 512);
    memset(units, 0, nb * 16 * sizeof(float));
  }
  for (int r = 0; r < rows; r++) {
    const char* row = xq + r * rb;
    const float* d = reinterpret_cast<const float*>(row + 2 * KP);
    for (int64_t j = 0; j < nb; j++) {
      memcpy(digits + j * 512 + r * 32, row + j * 32, 32);
      memcpy(digits + j * 512 + (kAmxRows + r) * 32, row + KP + j * 32, 32);
      units[j * 16 + r] = d[j];
      units[j * 16 + kAmxRows + r] = d[nb + j];
    }
  }
}

// Block j's products into the set of its parity. (Tile numbers must be constants.)
__attribute__((target("amx-tile,amx-int8"))) inline void amx_block_products(const uint8_t* w, const int8_t* digits,
                                                                           int64_t j) {
  if (j % 2 == 0) {
    _tile_loadd(0, digits + j * 512, 32);
    _tile_loadd(2, w + j * 512, 64);
    _tile_zero(4);
    _tile_dpbsud(4, 0, 2);
  } else {
    _tile_loadd(1, digits + j * 512, 32);
    _tile_loadd(3, w + j * 512, 64);
    _tile_zero(5);
    _tile_dpbsud(5, 1, 3);
  }
}

// out[r][0..16) = what group_dot gives for R (<= kAmxRows) activation rows (packed by pack_activations) against
// nb blocks of one group's 8-bit weights w (512 bytes a block) and its scales and offsets (16 a block, S as in
// group_dot; offset NULL: mid * scale, mid the weight's kMidOffset, qdot.h).
// R is a constant so that the sums stay in registers. The tiles must be configured (amx_configure_qdot).
// prefetch: ask for w, scale and offset ahead (prefetch_block), on the pass that streams them from memory.
template <int R, typename S>
__attribute__((target("amx-tile,amx-int8"))) inline void amx_group_dot(const uint8_t* w, const S* scale,
                                                                      const S* offset, float mid,
                                                                      const int8_t* digits, const float* units,
                                                                      int64_t nb, float* out, bool prefetch) {
  alignas(64) int32_t c[2 * kAmxRows * 16];
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  amx_block_products(w, digits, 0);
  for (int64_t j = 0; j < nb; j++) {
    if (prefetch) prefetch_block<8>(w, scale, offset, j);
    if (j + 1 < nb) amx_block_products(w, digits, j + 1);
    if (j % 2 == 0)
      _tile_stored(4, c, 64);
    else
      _tile_stored(5, c, 64);
    const __m512 a = load_scales(scale + j * 16);
    const __m512 b = load_offsets(offset, a, j * 16, mid);
    const float* u = units + j * 16;
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const __m512i dot = combine_digits(_mm512_load_si512(c + r * 16), _mm512_load_si512(c + (kAmxRows + r) * 16));
      acc[r] = add_block(acc[r], dot, a, b, u[r], u[kAmxRows + r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * 16, acc[r]);
}

// amx_group_dot for r (1 .. R) rows.
template <int R, typename S>
inline void amx_group_dot_upto(int r, const uint8_t* w, const S* scale, const S* offset, float mid,
                               const int8_t* digits, const float* units, int64_t nb, float* out, bool prefetch) {
  if constexpr (R > 1) {
    if (r < R) return amx_group_dot_upto<R - 1>(r, w, scale, offset, mid, digits, units, nb, out, prefetch);
  }
  amx_group_dot<R>(w, scale, offset, mid, digits, units, nb, out, prefetch);
}
#else
inline void amx_configure_qdot() { abort(); }
template <typename S>
inline void unpack_q4_group(const uint8_t*, const S*, const S*, int64_t, uint8_t*) { abort(); }
inline void pack_activations(const char*, int64_t, int64_t, int, int8_t*, float*) { abort(); }
template <int R, typename S>
inline void amx_group_dot_upto(int, const uint8_t*, const S*, const S*, float, const int8_t*, const float*, int64_t,
                               float*, bool) {
  abort();
}
#endif

}  // namespace qdot
}  // namespace cvk
