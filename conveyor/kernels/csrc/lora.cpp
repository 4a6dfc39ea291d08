// Many LoRA adapters in one step (cvk_lora_apply): y[rows] += (x[rows] A[slot]) B[slot], rows grouped by adapter.
//
// The base GEMM has run for every row of the step; this adds each row's own adapter's low-rank product, so a
// step with rows of 8 adapters (and rows of none) reads each adapter's small matrices once per row block instead
// of running the base GEMM per adapter (S-LoRA / Punica's "segmented" computation, written for the CPU):
//   shrink: xa[i, 0:SR] = x[rows[i], :] A[slot]        A [slots][K][SR], SR = subs x R
//   expand: y[rows[i], c] += xa[i, p R : (p + 1) R] B[slot][p R : (p + 1) R, c]   for column c of sub p
// A fused projection (q/k/v in one qkv weight, gate/up) has one sub per part: its columns [sub_cols[p],
// sub_cols[p + 1]) read rank slice p only, so the block-diagonal zeros of B are never multiplied. Weights are
// float32 or bfloat16 (w_dtype; the scaling folded into B); x and y are the step's dtype, the sums float32.
// A decode step streams adapter bytes (8 rank-16 float32 adapters on SmolLM2 outweigh its Q4_1 layer), so
// bfloat16 weights halve them (widening one is a shift, exact) and each item's rows (up to kTR, a register tile)
// share every weight vector it loads: a decode step's few rows per adapter read its A and B once. Each sum runs
// over k (shrink) or the rank (expand) in order from zero, whichever thread runs the item, so the results do not
// depend on the thread count, and the layer stack's calls equal the per-layer path's bit for bit.
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "bf16.h"
#include "kernels.h"
#include "team.h"
#include "vec.h"

namespace cvk {
namespace {

// Rows per item, at most: each weight vector loaded serves this many rows' FMAs (8 x 2 accumulators in the
// expand: 16 of AVX-512's 32 registers; AVX2 has 16 registers in all). An item of fewer rows is compiled for
// exactly that many (a decode step's 5 rows of an adapter compute 5, not 8).
constexpr int kTR = CVK_AVX512_LANES ? 8 : 4;

// One work item: up to kTR rows of one segment, shrunk then expanded over every output column by one thread.
// Its rows' xa are its own, so no barrier separates the two phases: a call costs one barrier (its loop's end).
struct Item {
  int64_t seg, r0, nr;
};

// xa[r0 + r, :] = x[rows[r0 + r], :] A[slot] for the item's NR rows: every vector of A's columns is read once for
// all of them.
template <int NR, class T, class Wt>
void shrink(const CvkLoraArgs& a, const Item& it, float* xa) {
  const Wt* A = static_cast<const Wt*>(a.a) + a.seg_slot[it.seg] * a.K * a.SR;
  const int64_t SR = a.SR, K = a.K;
  const T* xr[NR];
  for (int r = 0; r < NR; r++) xr[r] = static_cast<const T*>(a.x) + a.rows[it.r0 + r] * a.x_stride;
  float* out = xa + it.r0 * SR;
  int64_t j0 = 0;
  for (; j0 + W <= SR; j0 += W) {
    V acc[NR];
    for (int r = 0; r < NR; r++) acc[r] = V::zero();
    for (int64_t k = 0; k < K; k++) {
      const V av = V::load(A + k * SR + j0);
#pragma GCC unroll 8
      for (int r = 0; r < NR; r++) acc[r] = V::fma(V::set1(to_f32(xr[r][k])), av, acc[r]);
    }
    for (int r = 0; r < NR; r++) acc[r].store(out + r * SR + j0);
  }
  for (; j0 < SR; j0++)  // a rank that is not a multiple of the vector width: its last columns one by one
    for (int r = 0; r < NR; r++) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; k++) sum += to_f32(xr[r][k]) * to_f32(A[k * SR + j0]);
      out[r * SR + j0] = sum;
    }
}

// y[rows[r0 + r], c : c + NV W] += xa[r0 + r, sub R : (sub + 1) R] B[slot][sub R : (sub + 1) R, c : c + NV W]:
// each vector of B read once for the item's rows.
template <int NR, int NV, class T, class Wt>
inline void expand_tile(const float* const* xr, T* const* yr, const Wt* B, int64_t N, int64_t R, int64_t c) {
  V acc[NR][NV];
  for (int r = 0; r < NR; r++)
    for (int v = 0; v < NV; v++) acc[r][v] = V::zero();
  for (int64_t j = 0; j < R; j++) {
    V b[NV];
    for (int v = 0; v < NV; v++) b[v] = V::load(B + j * N + c + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++) {
      const V xv = V::set1(xr[r][j]);
      for (int v = 0; v < NV; v++) acc[r][v] = V::fma(xv, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < NR; r++)
    for (int v = 0; v < NV; v++) (V::load(yr[r] + c + v * W) + acc[r][v]).store(yr[r] + c + v * W);
}

template <int NR, class T, class Wt>
void expand(const CvkLoraArgs& a, const Item& it, int64_t sub, const float* xa) {
  const int64_t R = a.R, N = a.N, c1 = a.sub_cols[sub + 1];
  const Wt* B = static_cast<const Wt*>(a.b) + (a.seg_slot[it.seg] * a.SR + sub * R) * N;
  const float* xr[NR];
  T* yr[NR];
  for (int r = 0; r < NR; r++) {
    xr[r] = xa + (it.r0 + r) * a.SR + sub * R;
    yr[r] = static_cast<T*>(a.y) + a.rows[it.r0 + r] * a.y_stride;
  }
  int64_t c = a.sub_cols[sub];
  for (; c + 2 * W <= c1; c += 2 * W) expand_tile<NR, 2>(xr, yr, B, N, R, c);
  for (; c + W <= c1; c += W) expand_tile<NR, 1>(xr, yr, B, N, R, c);
  for (; c < c1; c++)  // a part's width that is not a multiple of the vector width: its last columns
    for (int r = 0; r < NR; r++) {
      float sum = 0.0f;
      for (int64_t j = 0; j < R; j++) sum += xr[r][j] * to_f32(B[j * N + c]);
      from_f32(to_f32(yr[r][c]) + sum, yr[r] + c);
    }
}

// An item of it.nr rows (1 ..= NR), by the code compiled for exactly that many.
template <class T, class Wt, int NR = kTR>
void run_item(const CvkLoraArgs& a, const Item& it) {
  if constexpr (NR > 1) {
    if (it.nr < NR) return run_item<T, Wt, NR - 1>(a, it);
  }
  shrink<NR, T, Wt>(a, it, a.scratch);
  for (int64_t p = 0; p < a.num_subs; p++) expand<NR, T, Wt>(a, it, p, a.scratch);
}

template <class T, class Wt>
void run(const CvkLoraArgs& a, const std::vector<Item>& items) {
  const int64_t n = int64_t(items.size());
  on_team(std::max(1, int(a.num_threads)), [&] {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) run_item<T, Wt>(a, items[i]);
  });
}

}  // namespace

int lora_apply(const CvkLoraArgs& a) {
  if ((a.dtype != CVK_F32 && a.dtype != CVK_BF16) || (a.w_dtype != CVK_F32 && a.w_dtype != CVK_BF16))
    return CVK_ERR_BADARG;
  if (a.num_segs <= 0) return CVK_OK;
  if (a.R <= 0 || a.num_subs <= 0 || a.SR != a.R * a.num_subs || a.sub_cols[0] != 0 || a.sub_cols[a.num_subs] != a.N)
    return CVK_ERR_BADARG;
  std::vector<Item> items;
  for (int64_t s = 0; s < a.num_segs; s++)
    for (int64_t r0 = a.seg_start[s]; r0 < a.seg_start[s + 1]; r0 += kTR)
      items.push_back({s, r0, std::min<int64_t>(kTR, a.seg_start[s + 1] - r0)});
  if (a.dtype == CVK_F32 && a.w_dtype == CVK_F32)
    run<float, float>(a, items);
  else if (a.dtype == CVK_F32)
    run<float, uint16_t>(a, items);
  else if (a.w_dtype == CVK_F32)
    run<uint16_t, float>(a, items);
  else
    run<uint16_t, uint16_t>(a, items);
  return CVK_OK;
}

}  // namespace cvk
