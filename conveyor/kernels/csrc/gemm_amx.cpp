// The bfloat16 skinny GEMM on AMX tiles: compiled at the avx512bf16 level only (a per-ISA file; other levels
// get a stub that nothing calls: the Python side and cvk_llama_layers use it only where cvk_amx_init granted AMX).
#include <stdint.h>
#include <stdlib.h>

#include <algorithm>

#include "amx.h"
#include "bf16.h"
#include "kernels.h"
#include "team.h"
#include "vec.h"

namespace cvk {

#if defined(CVK_AVX512BF16)
// Row count up to which amx_gemm_bf16 (below) asks for the next pair's weights itself: above it the prefetch
// made the GEMM over DRAM-resident weights 6-29% slower (33-128 rows), at 17-32 rows it made no difference, and
// dropping it above 32 made the whole SmolLM2 bfloat16 workload 4% faster (docs/kernels.md).
constexpr int64_t AMX_PREFETCH_ROWS = 32;

// AMX (Sapphire Rapids and later): the same skinny GEMM in bfloat16 on tile registers. A tile of 16 x's rows x
// 32 k against a tile of the packed weight (16 k-pairs x 16 columns: the layout above, so one 1 KB load) gives
// a 16 x 16 float32 block per TDPBF16PS. Weights stream once per 32 rows of x; up to 32 rows the loop is bound
// by that stream (oneDNN's AMX kernels reach about half of it at 17-128 rows: README); above, each pass re-reads
// its x rows from L2 for every pair of column blocks, and that traffic grows with the rows.
// Tiles: 0, 1 = x rows [m0, m0+16), [m0+16, m0+32); 2, 3 = two weight column blocks; 4-7 = the four results.
// swiglu: the packed weight is a fused gate_up projection (2 N columns, gate then up) and y [M, N] gets
// silu(gate) * up. A unit is then gate block b with its up block (N / 16 blocks on), so the product is formed
// in the epilogue from the two results rounded to bfloat16 as a plain gate_up GEMM stores them, in
// silu_mul_impl's arithmetic: bit-identical to the two calls, without the [M, 2 N] round trip or their
// barrier. Needs N % 16 == 0.
namespace {

__attribute__((target("amx-tile,amx-bf16")))
void amx_gemm_impl(const uint16_t* x, int64_t x_stride, int64_t M, const uint16_t* wp, const uint16_t* bias,
                   uint16_t* y, int64_t y_stride, int64_t N, int64_t K, int num_threads, bool swiglu) {
  const int64_t nblocks = (N + NBLK - 1) / NBLK, npairs = swiglu ? nblocks : (nblocks + 1) / 2;
  const int64_t block_elems = K * NBLK;
  const int threads = npairs < 4 ? 1 : std::max(1, num_threads);
  // (the lambda is a function of its own: it needs the AMX target too)
  on_team(threads, [&]() __attribute__((target("amx-tile,amx-bf16"))) {
    alignas(64) float c[4][16 * 16];
    int rows0 = -1, rows1 = -1;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < npairs; p++) {
      const uint16_t* w0 = wp + (swiglu ? p : 2 * p) * block_elems;
      const uint16_t* w1 = swiglu ? w0 + nblocks * block_elems : 2 * p + 1 < nblocks ? w0 + block_elems : w0;
      // The next pair's weights, asked for into L2 while this pair runs, spread over all its row groups (group
      // g of G takes every G-th line of a k step's share: asked for in the first group only, at 86-96 rows the
      // requests came in a third of the pair's time), so only a layer's first pair waits on memory. (Plain: the
      // two blocks follow each other; swiglu: 1 KB of each of the two per k step. At the present limit there is
      // one group, but the share-out stays: written without it, with a constant stride, the kernel ran 8-12%
      // slower at 8-32 rows in either order of an alternated A/B, its prefetch and tile loops alike in the
      // disassembly: code placement, most likely.) Only up to AMX_PREFETCH_ROWS
      // rows: with more, the tile loads of the x rows (and of the pair's weights for the later groups) miss L1
      // too, and the prefetches queued behind them for the line fill buffers stalled the loop (perf, 64 rows: a
      // third of the samples on them); the hardware prefetcher alone streamed the weights faster.
      const char* next = p + 1 < npairs && M <= AMX_PREFETCH_ROWS
                             ? reinterpret_cast<const char*>(w0 + (swiglu ? 1 : 2) * block_elems) : nullptr;
      const int64_t twin = nblocks * block_elems * 2;  // swiglu: bytes from a gate block to its up block
      const int64_t groups = (M + 31) / 32;            // row groups of 32 x rows: the prefetch is shared out over them
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int r0 = int(std::min<int64_t>(16, M - m0)), r1 = int(std::max<int64_t>(0, std::min<int64_t>(16, M - m0 - 16)));
        if (r0 != rows0 || r1 != rows1) {
          amx_configure(r0, r1);
          rows0 = r0;
          rows1 = r1;
        }
        const int64_t g = m0 / 32;  // this row group's share of the next pair's lines
        const uint16_t* xa = x + m0 * x_stride;
        const uint16_t* xb = xa + 16 * x_stride;
        const int64_t xs = x_stride * 2;
        _tile_zero(4);
        _tile_zero(5);
        if (r1) {
          _tile_zero(6);
          _tile_zero(7);
        }
        for (int64_t k = 0; k < K; k += 32) {
          if (next) {
            // this k step reads 2 x 1 KB of its pair: 2 KB of the next pair's (both blocks in order) are asked
            // for over the pair's row groups, this one taking lines g, g + groups, ...
            if (swiglu) {
              for (int64_t b = k * NBLK * 2 + 64 * g; b < k * NBLK * 2 + 1024; b += 64 * groups) {
                _mm_prefetch(next + b, _MM_HINT_T1);
                _mm_prefetch(next + twin + b, _MM_HINT_T1);
              }
            } else {
              const int64_t off = k * NBLK * 4;
              const int64_t next_bytes = std::min<int64_t>(2, nblocks - 2 * (p + 1)) * block_elems * 2;
              for (int64_t b = off + 64 * g; b < std::min(off + 2048, next_bytes); b += 64 * groups) _mm_prefetch(next + b, _MM_HINT_T1);
            }
          }
          _tile_loadd(0, xa + k, xs);
          _tile_loadd(2, w0 + k * NBLK, 64);
          _tile_loadd(3, w1 + k * NBLK, 64);
          _tile_dpbf16ps(4, 0, 2);
          _tile_dpbf16ps(5, 0, 3);
          if (r1) {
            _tile_loadd(1, xb + k, xs);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
          }
        }
        _tile_stored(4, c[0], 64);
        _tile_stored(5, c[1], 64);
        if (r1) {
          _tile_stored(6, c[2], 64);
          _tile_stored(7, c[3], 64);
        }
        if (swiglu) {
          const int64_t n0 = p * NBLK;
          const V one = V::set1(1.f);
          alignas(64) uint16_t gb[16], ub[16];
          for (int half = 0; half < 2; half++)
            for (int r = 0; r < (half ? r1 : r0); r++) {
              V g = V::load(c[2 * half] + r * 16), u = V::load(c[2 * half + 1] + r * 16);
              if (bias) {
                g = g + V::load(bias + n0);
                u = u + V::load(bias + N + n0);
              }
              g.store(gb);  // rounded to bfloat16, as the gate_up output would hold them
              u.store(ub);
              g = V::load(gb);
              const V sg = g * V::rcp(one + V::exp(V::zero() - g));
              (sg * V::load(ub)).store(y + (m0 + 16 * half + r) * y_stride + n0);
            }
          continue;
        }
        const int64_t n0 = 2 * p * NBLK;
        const int nc = int(std::min<int64_t>(32, N - n0));
        for (int half = 0; half < 2; half++) {
          const int rows = half ? r1 : r0;
          for (int r = 0; r < rows; r++) {
            uint16_t* dst = y + (m0 + 16 * half + r) * y_stride + n0;
            for (int b = 0; b < 2; b++) {
              const int cols = std::min(16, nc - 16 * b);
              if (cols <= 0) break;
              const float* src = c[2 * half + b] + r * 16;
              if (cols == 16) {
                V v = V::load(src);
                if (bias) v = v + V::load(bias + n0 + 16 * b);
                v.store(dst + 16 * b);
              } else {
                for (int j = 0; j < cols; j++)
                  from_f32(src[j] + (bias ? to_f32(bias[n0 + 16 * b + j]) : 0.f), dst + 16 * b + j);
              }
            }
          }
        }
      }
    }
    if (rows0 >= 0) _tile_release();
  });
}

}  // namespace

void amx_gemm_bf16(const uint16_t* x, int64_t x_stride, int64_t M, const uint16_t* wp, const uint16_t* bias,
                   uint16_t* y, int64_t y_stride, int64_t N, int64_t K, int num_threads, bool swiglu) {
  amx_gemm_impl(x, x_stride, M, wp, bias, y, y_stride, N, K, num_threads, swiglu);
}
#else
void amx_gemm_bf16(const uint16_t*, int64_t, int64_t, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t,
                   int64_t, int, bool) {
  abort();
}
#endif

}  // namespace cvk
