// The bfloat16 skinny GEMM on VDPBF16PS dot products, for CPUs with AVX512_BF16 but no AMX (Zen 4, Zen 5, Cooper
// Lake): compiled at the avx512bf16 level only (a per-ISA file; the other levels get a stub that skinny_gemm never
// calls, since kBf16Dot is false there and their bfloat16 goes through its emulated loop or, from Python, oneDNN).
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "bf16.h"
#include "kernels.h"
#include "team.h"
#include "unit_prefetch.h"
#include "vec.h"

namespace cvk {

#if defined(CVK_AVX512BF16)
namespace {

// The packed layout is cvk_skinny_gemm's bfloat16 one, Wp[N / 16][K / 2][16][2] (the AMX GEMM's too): per k pair
// one 64-byte line of a 16-column block, which one VDPBF16PS multiplies by a row's (x[2k], x[2k+1]) broadcast to
// every lane. A unit is NB adjacent column blocks; each thread takes one contiguous range of units; a unit's
// row tiles of up to R rows keep R x NB float32 accumulators in registers over the whole K (so every output sums
// its k pairs in order in one accumulator, whatever the row count: a row's result does not depend on the batch).
//
// One row tile (M <= TR, decode steps): bound by the weight stream, so each block's lines BD_AHEAD k pairs
// (4 KB) ahead are asked for into L2, as the float32 loop does (past a unit's end that is this thread's next
// unit). Several tiles: the unit's weights are read from L2 by the later tiles, and the next unit's are streamed
// in over all the passes (UnitPrefetch).
constexpr int64_t BD_AHEAD = 64;

// swiglu: the packed weight is a fused gate_up projection (2 N columns, gate then up) and y [T, N] gets
// silu(gate) * up: a unit's first NB / 2 blocks are gate blocks, the others their up blocks, and the epilogue
// forms the product from the two results rounded to bfloat16 as the gate_up GEMM stores them, in silu_mul's
// arithmetic: bit-identical to the two calls (the AMX GEMM's epilogue), without the [T, 2 N] round trip and a
// barrier. Needs N % 16 == 0.
template <int NB, int R, bool AHEAD, bool SWIGLU>
inline void bd_tile(const uint16_t* x, int64_t x_stride, const uint16_t* const* w, int64_t K2, UnitPrefetch* pf,
                    const uint16_t* bias, uint16_t* y, int64_t y_stride, int64_t n0, int64_t N) {
  __m512 a[R][NB];
  for (int r = 0; r < R; r++)
    for (int b = 0; b < NB; b++) a[r][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; k++) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; b++) wv[b] = (__m512bh)_mm512_loadu_si512(w[b] + k * 2 * NBLK);
    if constexpr (AHEAD) {
      for (int b = 0; b < NB; b++)
        _mm_prefetch(reinterpret_cast<const char*>(w[b] + (k + BD_AHEAD) * 2 * NBLK), _MM_HINT_T1);
    } else {
      if (pf[0].next) pf[0].step();
      if (SWIGLU && pf[1].next) pf[1].step();
    }
    for (int r = 0; r < R; r++) {
      uint32_t pair;
      memcpy(&pair, x + r * x_stride + 2 * k, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(pair));
      for (int b = 0; b < NB; b++) a[r][b] = _mm512_dpbf16_ps(a[r][b], xv, wv[b]);
    }
  }
  if constexpr (SWIGLU) {
    const V one = V::set1(1.f);
    for (int b = 0; b < NB / 2; b++) {
      const int64_t c0 = n0 + b * NBLK;
      if (c0 >= N) break;
      const V bg = bias ? V::load(bias + c0) : V::zero(), bu = bias ? V::load(bias + N + c0) : V::zero();
      for (int r = 0; r < R; r++) {
        alignas(64) uint16_t gb[NBLK], ub[NBLK];
        (V{a[r][b]} + bg).store(gb);  // rounded to bfloat16, as the gate_up output would hold them
        (V{a[r][NB / 2 + b]} + bu).store(ub);
        const V g = V::load(gb);
        const V sg = g * V::rcp(one + V::exp(V::zero() - g));
        (sg * V::load(ub)).store(y + r * y_stride + c0);
      }
    }
    return;
  }
  // y = acc + bias (float32), rounded to bfloat16 (nearest even), as skinny_store does
  for (int b = 0; b < NB; b++) {
    const int64_t c0 = n0 + b * NBLK;
    if (c0 >= N) break;
    const int cols = int(std::min<int64_t>(NBLK, N - c0));
    alignas(64) float bt[NBLK] = {};
    if (bias != nullptr)
      for (int j = 0; j < cols; j++) bt[j] = to_f32(bias[c0 + j]);
    const V bv = V::load(bt);
    for (int r = 0; r < R; r++) {
      const V v = V{a[r][b]} + bv;
      if (cols == NBLK) {
        v.store(y + r * y_stride + c0);
      } else {
        alignas(64) uint16_t t[NBLK];
        v.store(t);
        memcpy(y + r * y_stride + c0, t, size_t(cols) * 2);
      }
    }
  }
}

// N: the output columns (swiglu: the gate's, half the packed weight's).
template <int NB, int TR, bool SWIGLU>
void bd_gemm_units(const uint16_t* x, int64_t x_stride, int64_t M, const uint16_t* wp, const uint16_t* bias,
                   uint16_t* y, int64_t y_stride, int64_t N, int64_t K, int threads) {
  constexpr int NO = SWIGLU ? NB / 2 : NB;  // output blocks per unit
  const int64_t nblocks = (N + NBLK - 1) / NBLK, nunits = (nblocks + NO - 1) / NO, block_elems = K * NBLK;
  const int64_t K2 = K / 2, tiles = (M + TR - 1) / TR;
  const int64_t twin = nblocks * block_elems;  // swiglu: elements from a gate block to its up block
  on_team(threads, [&] {
    // One contiguous range of units per thread (the prefetches must know which unit this thread takes next).
    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t u_end = nunits * (tid + 1) / nt;
    for (int64_t u = nunits * tid / nt; u < u_end; u++) {
      const uint16_t* w[NB];
      for (int b = 0; b < NO; b++) {  // blocks past the last repeat it (computed, never stored)
        w[b] = wp + std::min(NO * u + b, nblocks - 1) * block_elems;
        if constexpr (SWIGLU) w[NO + b] = w[b] + twin;
      }
      UnitPrefetch pf[2];
      if (tiles > 1 && u + 1 < u_end) {  // a unit's blocks are adjacent: one run of K / 2 lines per block
        const int64_t next_blocks = std::min<int64_t>(NO, nblocks - NO * (u + 1));
        for (int h = 0; h < (SWIGLU ? 2 : 1); h++) {  // swiglu: its gate blocks, then its up blocks
          pf[h].next = reinterpret_cast<const char*>(wp + NO * (u + 1) * block_elems + h * twin);
          pf[h].lines = next_blocks * K2;
          pf[h].rate = uint32_t(next_blocks * 65536 / tiles);
        }
      }
      for (int64_t t = 0; t < tiles; t++) {
        const uint16_t* xt = x + t * TR * x_stride;
        uint16_t* yt = y + t * TR * y_stride;
        const int64_t n0 = NO * u * NBLK;
        switch (std::min<int64_t>(TR, M - t * TR)) {
#define CVK_BD_CASE(RR)                                                                                      \
  case RR:                                                                                                   \
    if constexpr (RR <= TR) {                                                                                \
      if (tiles == 1)                                                                                        \
        bd_tile<NB, RR, true, SWIGLU>(xt, x_stride, w, K2, pf, bias, yt, y_stride, n0, N);                   \
      else                                                                                                   \
        bd_tile<NB, RR, false, SWIGLU>(xt, x_stride, w, K2, pf, bias, yt, y_stride, n0, N);                  \
    }                                                                                                        \
    break;
          CVK_BD_CASE(1) CVK_BD_CASE(2) CVK_BD_CASE(3) CVK_BD_CASE(4) CVK_BD_CASE(5) CVK_BD_CASE(6)
          CVK_BD_CASE(7) CVK_BD_CASE(8)
#undef CVK_BD_CASE
          default: break;
        }
      }
    }
#pragma omp barrier
    // (inside the layer stack the next phase reads y)
  });
}

template <bool SWIGLU>
void bd_gemm(const uint16_t* x, int64_t x_stride, int64_t M, const uint16_t* wp, const uint16_t* bias, uint16_t* y,
             int64_t y_stride, int64_t N, int64_t K, int num_threads) {
  const int64_t nblocks = (N + NBLK - 1) / NBLK * (SWIGLU ? 2 : 1), pairs = (nblocks + 1) / 2;
  const int64_t quads = (nblocks + 3) / 4;
  const int threads = pairs < 4 ? 1 : std::max(1, num_threads);
  // Past one 8-row tile, units of four blocks x 6-row tiles (24 accumulators: 10 loads per 24 dot products
  // instead of 10 per 16) where the threads get even shares of them (within 1/16), as the float32 loop.
  if (M > 8 && quads >= 4 * threads && (quads + threads - 1) / threads * threads * 15 <= quads * 16)
    bd_gemm_units<4, 6, SWIGLU>(x, x_stride, M, wp, bias, y, y_stride, N, K, threads);
  else
    bd_gemm_units<2, 8, SWIGLU>(x, x_stride, M, wp, bias, y, y_stride, N, K, threads);
}

}  // namespace

void skinny_gemm_bf16dot(const uint16_t* x, int64_t x_stride, int64_t M, const uint16_t* wp, const uint16_t* bias,
                         uint16_t* y, int64_t y_stride, int64_t N, int64_t K, int num_threads, bool swiglu) {
  if (swiglu)
    bd_gemm<true>(x, x_stride, M, wp, bias, y, y_stride, N, K, num_threads);
  else
    bd_gemm<false>(x, x_stride, M, wp, bias, y, y_stride, N, K, num_threads);
}
#else
void skinny_gemm_bf16dot(const uint16_t*, int64_t, int64_t, const uint16_t*, const uint16_t*, uint16_t*, int64_t,
                         int64_t, int64_t, int, bool) {
  abort();
}
#endif

}  // namespace cvk
