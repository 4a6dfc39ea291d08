// Many LoRA adapters in one step (cvk_lora_apply): y[rows] += (x[rows] A[slot]) B[slot], rows grouped by adapter.
//
// The base GEMM has run for every row of the step; this adds each row's own adapter's low-rank product, so a
// step with rows of 8 adapters (and rows of none) reads each adapter's small matrices once per row block instead
// of running the base GEMM per adapter (S-LoRA / Punica's "segmented" computation, written for the CPU):
//   shrink: xa[i, 0:SR] = x[rows[i], :] A[slot]        A [slots][K][SR], SR = subs x R
//   expand: y[rows[i], c] += xa[i, p R : (p + 1) R] B[slot][p R : (p + 1) R, c]   for column c of sub p
// A fused projection (q/k/v in one qkv weight, gate/up) has one sub per part: its columns [sub_cols[p],
// sub_cols[p + 1]) read rank slice p only, so the block-diagonal zeros of B are never multiplied. Weights are
// float32 (the scaling folded into B); x and y are the step's dtype, the sums float32.
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "bf16.h"
#include "kernels.h"
#include "team.h"

namespace cvk {
namespace {

constexpr int64_t kRowBlock = 4;  // rows sharing one read of an adapter's weights
constexpr int64_t kColBlock = 64;  // output columns per expand item: 4 rows x 64 floats stay in registers

struct ShrinkItem {
  int64_t seg, r0, nr;
};
struct ExpandItem {
  int64_t seg, r0, nr, c0, c1, sub;
};

template <class T>
void shrink(const CvkLoraArgs& a, const ShrinkItem& it, float* xa) {
  const T* x = static_cast<const T*>(a.x);
  const float* A = a.a + a.seg_slot[it.seg] * a.K * a.SR;
  const int64_t SR = a.SR;
  const int64_t* rows = a.rows + it.r0;
  float* out = xa + it.r0 * SR;
  for (int64_t i = 0; i < it.nr * SR; i++) out[i] = 0.0f;
  for (int64_t k = 0; k < a.K; k++) {
    const float* ak = A + k * SR;
    for (int64_t r = 0; r < it.nr; r++) {
      const float xv = to_f32(x[rows[r] * a.x_stride + k]);
      float* o = out + r * SR;
#pragma omp simd
      for (int64_t j = 0; j < SR; j++) o[j] += xv * ak[j];
    }
  }
}

template <class T>
void expand(const CvkLoraArgs& a, const ExpandItem& it, const float* xa) {
  T* y = static_cast<T*>(a.y);
  const float* B = a.b + a.seg_slot[it.seg] * a.SR * a.N;
  const int64_t R = a.R, SR = a.SR, N = a.N, width = it.c1 - it.c0;
  float acc[kRowBlock][kColBlock];
  for (int64_t r = 0; r < it.nr; r++)
    for (int64_t c = 0; c < kColBlock; c++) acc[r][c] = 0.0f;
  for (int64_t j = it.sub * R; j < (it.sub + 1) * R; j++) {
    const float* bj = B + j * N + it.c0;
    for (int64_t r = 0; r < it.nr; r++) {
      const float xv = xa[(it.r0 + r) * SR + j];
#pragma omp simd
      for (int64_t c = 0; c < width; c++) acc[r][c] += xv * bj[c];
    }
  }
  for (int64_t r = 0; r < it.nr; r++) {
    T* yr = y + a.rows[it.r0 + r] * a.y_stride + it.c0;
    for (int64_t c = 0; c < width; c++) from_f32(to_f32(yr[c]) + acc[r][c], yr + c);
  }
}

template <class T>
void run(const CvkLoraArgs& a, const std::vector<ShrinkItem>& shrinks, const std::vector<ExpandItem>& expands) {
  const int64_t ns = int64_t(shrinks.size()), ne = int64_t(expands.size());
  on_team(std::max(1, int(a.num_threads)), [&] {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < ns; i++) shrink<T>(a, shrinks[i], a.scratch);
    // (the loop's barrier: every row's xa is complete before any expand reads it)
#pragma omp for schedule(static)
    for (int64_t i = 0; i < ne; i++) expand<T>(a, expands[i], a.scratch);
  });
}

}  // namespace

int lora_apply(const CvkLoraArgs& a) {
  if (a.dtype != CVK_F32 && a.dtype != CVK_BF16) return CVK_ERR_BADARG;
  if (a.num_segs <= 0) return CVK_OK;
  if (a.R <= 0 || a.num_subs <= 0 || a.SR != a.R * a.num_subs || a.sub_cols[0] != 0 || a.sub_cols[a.num_subs] != a.N)
    return CVK_ERR_BADARG;
  std::vector<ShrinkItem> shrinks;
  std::vector<ExpandItem> expands;
  for (int64_t s = 0; s < a.num_segs; s++) {
    for (int64_t r0 = a.seg_start[s]; r0 < a.seg_start[s + 1]; r0 += kRowBlock) {
      const int64_t nr = std::min(kRowBlock, a.seg_start[s + 1] - r0);
      shrinks.push_back({s, r0, nr});
      for (int64_t p = 0; p < a.num_subs; p++)
        for (int64_t c0 = a.sub_cols[p]; c0 < a.sub_cols[p + 1]; c0 += kColBlock)
          expands.push_back({s, r0, nr, c0, std::min(c0 + kColBlock, a.sub_cols[p + 1]), p});
    }
  }
  if (a.dtype == CVK_F32)
    run<float>(a, shrinks, expands);
  else
    run<uint16_t>(a, shrinks, expands);
  return CVK_OK;
}

}  // namespace cvk
