// The skinny GEMM for decode-sized batches, float32 and bfloat16 (at the avx512bf16 level bfloat16 runs
// gemm_bf16dot.cpp's VDPBF16PS loop).
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "bf16.h"
#include "kernels.h"
#include "team.h"
#include "unit_prefetch.h"
#include "vec.h"

namespace cvk {
namespace {

// Skinny GEMM for decode-sized batches: y[M, N] = x[M, K] W^T (+ bias), M small, W streamed once from a packed
// layout: blocks of 16 output columns, k-major inside a block, so each block is one sequential read:
//   float32:  Wp[N / 16][K][16]
//   bfloat16: Wp[N / 16][K / 2][16][2]  (pairs of k per output: VDPBF16PS's operand layout)
// At these shapes the GEMM is bound by how fast W streams from memory; oneDNN's small-M kernels reach a
// fraction of that in float32 (measured in benchmarks/gemm.py), so this loop keeps every load useful.
constexpr int SK_ROWS = W == 16 ? 8 : 2;  // rows of x per register tile (AVX2 has 16 registers)

// The two blocks' lines SK_AHEAD k steps (4 KB) ahead, into L2: at one row tile (M <= SK_ROWS) the loop is bound
// by the weight stream, and the hardware prefetcher alone, two streams a block apart, left bandwidth unused
// (a sequential-read probe, 2 threads: 21.6 GB/s plain, 25-29 with a 4-8 KB software prefetch). With it the
// 1-8-row GEMM over DRAM-resident weights took 9-25% less time; 32 and 128 steps ahead were within 3% of 64
// (docs/kernels.md). Past a block's end it asks for the next block's first lines, which this thread reads
// next under the static schedule.
constexpr int64_t SK_AHEAD = 64;
inline void skinny_prefetch_ahead(const float* wp0, const float* wp1, int64_t k) {
  _mm_prefetch(reinterpret_cast<const char*>(wp0 + (k + SK_AHEAD) * NBLK), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(wp1 + (k + SK_AHEAD) * NBLK), _MM_HINT_T1);
}

// One row tile (R rows) x two column blocks.
template <int R>
inline void skinny_tile_f32(const float* x, int64_t x_stride, const float* wp0, const float* wp1, int64_t K,
                            float* acc_out /* [R][32] */) {
  constexpr int NV = NBLK / W;  // vectors per column block
  V a[R][2 * NV];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 2 * NV; c++) a[r][c] = V::zero();
  for (int64_t k = 0; k < K; k++) {
    V w[2 * NV];
    for (int c = 0; c < NV; c++) {
      w[c] = V::load(wp0 + k * NBLK + c * W);
      w[NV + c] = V::load(wp1 + k * NBLK + c * W);
    }
    skinny_prefetch_ahead(wp0, wp1, k);
    for (int r = 0; r < R; r++) {
      const V xv = V::set1(x[r * x_stride + k]);
      for (int c = 0; c < 2 * NV; c++) a[r][c] = V::fma(xv, w[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 2 * NV; c++) a[r][c].store(acc_out + r * 32 + c * W);
}

// bfloat16 below the avx512bf16 level (that level runs gemm_bf16dot.cpp): x pairs (x[2k], x[2k+1]) against
// packed W pairs, with no bf16 arithmetic: each pair split into its even-k and odd-k float32 halves (a shift and
// a mask).
template <int R>
inline void skinny_tile_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* wp0, const uint16_t* wp1,
                             int64_t K, float* acc_out) {
  const int64_t K2 = K / 2;
  float acc[R][32];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 32; c++) acc[r][c] = 0.f;
  for (int half = 0; half < 2; half++) {
    const uint16_t* wp = half ? wp1 : wp0;
    for (int c0 = 0; c0 < NBLK; c0 += W) {
      V a[R];
      for (int r = 0; r < R; r++) a[r] = V::zero();
      for (int64_t k = 0; k < K2; k++) {
        // 16 outputs x 2 k as 32 bf16; this vector's W outputs: lanes c0 .. c0 + W
        V we, wo;
        V::load_bf16_pairs(wp + k * 2 * NBLK + 2 * c0, we, wo);
        for (int r = 0; r < R; r++) {
          a[r] = V::fma(V::set1(to_f32(x[r * x_stride + 2 * k])), we, a[r]);
          a[r] = V::fma(V::set1(to_f32(x[r * x_stride + 2 * k + 1])), wo, a[r]);
        }
      }
      for (int r = 0; r < R; r++) a[r].store(acc[r] + half * 16 + c0);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 32; c++) acc_out[r * 32 + c] = acc[r][c];
}

template <typename T>
void skinny_store(const float* acc, int R, const T* bias, int64_t n0, int64_t N, T* y, int64_t y_stride,
                  int acc_stride = 32) {
  const int nc = int(std::min<int64_t>(32, N - n0));
  if constexpr (sizeof(T) == 4) {  // float32: masked vector stores (a scalar loop costs ~10% at 96 rows)
    const float* b = reinterpret_cast<const float*>(bias);
    for (int r = 0; r < R; r++) {
      float* out = reinterpret_cast<float*>(y) + r * y_stride + n0;
      for (int c = 0; c < 32; c += W) {
        const V bv = b ? V::load_n(b + n0 + c, nc - c) : V::zero();
        (V::load(acc + r * acc_stride + c) + bv).store_n(out + c, nc - c);
      }
    }
    return;
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < nc; c++) {
      const float b = bias ? to_f32(bias[n0 + c]) : 0.f;
      from_f32(acc[r * acc_stride + c] + b, y + r * y_stride + n0 + c);
    }
}

// float32 past one row tile (M > SK_ROWS), where the GEMM turns compute-bound. The one-tile loop above re-reads a
// column pair's W (2 x K x 64 B: 64-180 KB, past L1) from L2 for every row tile and keeps 8 row pointers live,
// which spills them; here K is split into chunks whose W (2 or 4 blocks x SK_KC x 64 B = 16 or 32 KB) stays in
// L1 while every row tile passes over it, the thread's next unit of W is prefetched over this unit's passes
// (UnitPrefetch), and x is packed once per call k-major per tile (xp[tile][k][rows]: one pointer, a broadcast per
// row at fixed offsets).
// Each output still sums k = 0 .. K-1 in order in one float32 accumulator (stored and reloaded between chunks,
// which is exact), so results are bit-identical to the one-tile loop. 6-10% more GFLOP/s than it at 16-96
// rows; the chunk size (64/128/256) made no difference beyond the noise (docs/kernels.md).
constexpr int64_t SK_KC = 128;

// One row tile (R <= TR rows, x packed [k][TR]) x NB column blocks over kc values of k, accumulating into
// acc [R][NB * 16] (zeroed first on the first chunk). pf: the next unit's weights, a step of it per k.
template <int NB, int TR, int R>
inline void skinny_tile_f32_packed(const float* xp, const float* const* w, int64_t kc, float* acc, bool first,
                                   UnitPrefetch& pf) {
  constexpr int NV = NB * NBLK / W;  // accumulator vectors per row
  V a[R][NV];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < NV; c++) a[r][c] = first ? V::zero() : V::load(acc + r * NB * NBLK + c * W);
  for (int64_t k = 0; k < kc; k++) {
    V wv[NV];
    for (int c = 0; c < NV; c++) wv[c] = V::load(w[c * W / NBLK] + k * NBLK + c * W % NBLK);
    if (pf.next) pf.step();
    for (int r = 0; r < R; r++) {
      const V xv = V::set1(xp[k * TR + r]);
      for (int c = 0; c < NV; c++) a[r][c] = V::fma(xv, wv[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < NV; c++) a[r][c].store(acc + r * NB * NBLK + c * W);
}

// The k-chunked loop over units of NB column blocks (NB x 16 outputs) and row tiles of TR rows.
template <int NB, int TR>
void skinny_gemm_f32_units(const float* x, int64_t x_stride, int64_t M, const float* wp, const float* bias, float* y,
                           int64_t y_stride, int64_t N, int64_t K, int threads) {
  const int64_t nblocks = (N + NBLK - 1) / NBLK, nunits = (nblocks + NB - 1) / NB, block_elems = K * NBLK;
  const int64_t tiles = (M + TR - 1) / TR;
  on_team(threads, [&] {
    // x packed once, into one thread's buffer that the whole team reads (a team's threads are its own, so
    // two engines calling from two threads never share one)
    static thread_local std::vector<float> packed_x;
    float* xp;
#pragma omp single copyprivate(xp)
    {
      packed_x.resize(size_t(tiles * K * TR));
      xp = packed_x.data();
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const int64_t rows = std::min<int64_t>(TR, M - t * TR);
      float* dst = xp + t * K * TR;
      for (int64_t r = 0; r < rows; r++) {
        const float* src = x + (t * TR + r) * x_stride;
        for (int64_t k = 0; k < K; k++) dst[k * TR + r] = src[k];
      }
    }  // (implicit barrier: every tile is packed before any is read)
    static thread_local std::vector<float, AlignedAlloc<float>> acc_buf;
    acc_buf.resize(size_t(tiles * TR * NB * 16));
    float* acc = acc_buf.data();
    // One contiguous range of units per thread (schedule(static), made explicit: the prefetch must know which
    // unit this thread takes next).
    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t u_end = nunits * (tid + 1) / nt;
    for (int64_t u = nunits * tid / nt; u < u_end; u++) {
      const float* w[NB];
      for (int b = 0; b < NB; b++)  // blocks past the last repeat it (computed, never stored)
        w[b] = wp + std::min(NB * u + b, nblocks - 1) * block_elems;
      UnitPrefetch pf;
      if (u + 1 < u_end) {  // a unit's blocks are adjacent in the packed layout: one run of K lines per block
        const int64_t next_blocks = std::min<int64_t>(NB, nblocks - NB * (u + 1));
        pf.next = reinterpret_cast<const char*>(wp + NB * (u + 1) * block_elems);
        pf.lines = next_blocks * K;
        pf.rate = uint32_t(next_blocks * 65536 / tiles);
      }
      for (int64_t k0 = 0; k0 < K; k0 += SK_KC) {
        const int64_t kc = std::min(SK_KC, K - k0);
        const float* wk[NB];
        for (int b = 0; b < NB; b++) wk[b] = w[b] + k0 * NBLK;
        for (int64_t t = 0; t < tiles; t++) {
          const float* xt = xp + (t * K + k0) * TR;
          float* at = acc + t * TR * NB * 16;
          const bool first = k0 == 0;
          switch (std::min<int64_t>(TR, M - t * TR)) {
#define CVK_UNIT_CASE(RR) \
  case RR: if constexpr (RR <= TR) skinny_tile_f32_packed<NB, TR, RR>(xt, wk, kc, at, first, pf); break;
            CVK_UNIT_CASE(1) CVK_UNIT_CASE(2) CVK_UNIT_CASE(3) CVK_UNIT_CASE(4) CVK_UNIT_CASE(5) CVK_UNIT_CASE(6)
            CVK_UNIT_CASE(7) CVK_UNIT_CASE(8)
#undef CVK_UNIT_CASE
            default: break;
          }
        }
      }
      for (int64_t t = 0; t < tiles; t++)
        for (int h = 0; h < NB / 2; h++)
          if (NB * u * NBLK + 32 * h < N)
            skinny_store<float>(acc + t * TR * NB * 16 + h * 32, int(std::min<int64_t>(TR, M - t * TR)), bias,
                                NB * u * NBLK + 32 * h, N, y + t * TR * y_stride, y_stride, NB * 16);
    }
#pragma omp barrier
    // (the loop's own barrier, which its omp for had: inside the layer stack the next phase reads y)
  });
}

void skinny_gemm_f32_blocked(const float* x, int64_t x_stride, int64_t M, const float* wp, const float* bias, float* y,
                             int64_t y_stride, int64_t N, int64_t K, int threads) {
  // Units of four blocks (6 rows x 64 columns: 24 accumulators, 10 loads per 24 FMAs instead of 10 per 16) from
  // 40 rows, where the 6-row tiles pad little; with enough units that the threads get even shares (within 1/16).
  // 1-5% faster than pairs from 40 rows, 11% slower at 16 rows, so 9-39 rows keep the pairs (docs/kernels.md).
  const int64_t nblocks = (N + NBLK - 1) / NBLK, quads = (nblocks + 3) / 4;
  if (M >= 40 && quads >= 4 * threads && (quads + threads - 1) / threads * threads * 15 <= quads * 16)
    skinny_gemm_f32_units<4, 6>(x, x_stride, M, wp, bias, y, y_stride, N, K, threads);
  else
    skinny_gemm_f32_units<2, SK_ROWS>(x, x_stride, M, wp, bias, y, y_stride, N, K, threads);
}

template <typename T>
void skinny_gemm_impl(const T* x, int64_t x_stride, int64_t M, const T* wp, const T* bias, T* y, int64_t y_stride,
                      int64_t N, int64_t K, int num_threads) {
  const int64_t nblocks = (N + NBLK - 1) / NBLK;
  const int64_t npairs = (nblocks + 1) / 2;  // work unit: two column blocks (32 outputs)
  const int64_t block_elems = K * NBLK;
  const int threads = npairs < 4 ? 1 : std::max(1, num_threads);
  // (the k-blocked loop is tuned for AVX-512's 32 registers; AVX2 keeps the one-tile loop at every M)
  if constexpr (sizeof(T) == 4 && W == 16) {
    if (M > SK_ROWS) {
      skinny_gemm_f32_blocked(reinterpret_cast<const float*>(x), x_stride, M, reinterpret_cast<const float*>(wp),
                              reinterpret_cast<const float*>(bias), reinterpret_cast<float*>(y), y_stride, N, K,
                              threads);
      return;
    }
  }
  on_team(threads, [&] {
#pragma omp for schedule(static)
  for (int64_t p = 0; p < npairs; p++) {
    alignas(64) float acc[SK_ROWS * 32];
    const T* w0 = wp + 2 * p * block_elems;
    const T* w1 = 2 * p + 1 < nblocks ? w0 + block_elems : w0;  // an odd last block pairs with itself
    for (int64_t m0 = 0; m0 < M; m0 += SK_ROWS) {
      const int R = int(std::min<int64_t>(SK_ROWS, M - m0));
      const T* xr = x + m0 * x_stride;
#define CVK_SKINNY_CASE(RR)                                                                            \
  case RR:                                                                                             \
    if constexpr (RR > SK_ROWS) {                                                                      \
    } else if constexpr (sizeof(T) == 4)                                                               \
      skinny_tile_f32<RR>(reinterpret_cast<const float*>(xr), x_stride, reinterpret_cast<const float*>(w0), \
                          reinterpret_cast<const float*>(w1), K, acc);                                \
    else                                                                                               \
      skinny_tile_bf16<RR>(reinterpret_cast<const uint16_t*>(xr), x_stride,                           \
                           reinterpret_cast<const uint16_t*>(w0), reinterpret_cast<const uint16_t*>(w1), K, acc); \
    break;
      switch (R) {
        CVK_SKINNY_CASE(1)
        CVK_SKINNY_CASE(2)
        CVK_SKINNY_CASE(3)
        CVK_SKINNY_CASE(4)
        CVK_SKINNY_CASE(5)
        CVK_SKINNY_CASE(6)
        CVK_SKINNY_CASE(7)
        CVK_SKINNY_CASE(8)
      }
#undef CVK_SKINNY_CASE
      skinny_store<T>(acc, R, bias, 2 * p * NBLK, N, y + m0 * y_stride, y_stride);
    }
  }  });
}

}  // namespace

void skinny_gemm(int dtype, const void* x, int64_t x_stride, int64_t M, const void* wp, const void* bias, void* y,
                 int64_t y_stride, int64_t N, int64_t K, int num_threads) {
  if (dtype == 1 && kBf16Dot)
    skinny_gemm_bf16dot(static_cast<const uint16_t*>(x), x_stride, M, static_cast<const uint16_t*>(wp),
                        static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), y_stride, N, K, num_threads);
  else if (dtype == 0)
    skinny_gemm_impl<float>(static_cast<const float*>(x), x_stride, M, static_cast<const float*>(wp),
                            static_cast<const float*>(bias), static_cast<float*>(y), y_stride, N, K, num_threads);
  else
    skinny_gemm_impl<uint16_t>(static_cast<const uint16_t*>(x), x_stride, M, static_cast<const uint16_t*>(wp),
                               static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), y_stride, N, K,
                               num_threads);
}

}  // namespace cvk
