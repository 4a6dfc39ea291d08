// Row-wise argmax for greedy sampling.
#include <math.h>
#include <omp.h>

#include <algorithm>

#include "bf16.h"
#include "kernels.h"
#include "vec.h"

namespace cvk {
namespace {

// Row-wise argmax for greedy sampling, straight from the logits' dtype (bfloat16 logits need no float32 copy:
// the conversion is exact, so the order is the same). The first maximum wins; a NaN counts as the maximum and
// the first NaN wins (numpy's argmax, which the float32 path uses). Two passes over a row (in cache after the
// first): the maximum, then the first lane equal to it.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  const int64_t nv = n / W * W;
  V mx = V::set1(-INFINITY);
  bool nan = false;
  for (int64_t i = 0; i < nv; i += W) {
    const V v = V::load(x + i);
    nan = nan || V::any_nan(v);
    mx = V::max(mx, v);
  }
  float best = nv > 0 ? mx.hmax() : -INFINITY;
  for (int64_t i = nv; i < n; i++) {
    const float v = to_f32(x[i]);
    nan = nan || v != v;
    best = std::max(best, v);
  }
  if (nan) {
    for (int64_t i = 0; i < n; i++)
      if (to_f32(x[i]) != to_f32(x[i])) return i;
  }
  const V b = V::set1(best);
  for (int64_t i = 0; i < nv; i += W) {
    const int lane = V::first_eq(V::load(x + i), b);
    if (lane >= 0) return i + lane;
  }
  for (int64_t i = nv; i < n; i++)
    if (to_f32(x[i]) == best) return i;
  return 0;  // a row of -inf only: index 0, as numpy
}

template <typename T>
void argmax_rows_impl(const void* x, int64_t x_stride, int64_t rows, int64_t n, int64_t* out, int num_threads) {
  const int threads = rows * n < (1 << 16) ? 1 : std::max(1, num_threads);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; r++) out[r] = argmax_row<T>(static_cast<const T*>(x) + r * x_stride, n);
}

}  // namespace

void argmax_rows(int dtype, const void* x, int64_t x_stride, int64_t rows, int64_t n, int64_t* out, int num_threads) {
  if (dtype == 0) argmax_rows_impl<float>(x, x_stride, rows, n, out, num_threads);
  else argmax_rows_impl<uint16_t>(x, x_stride, rows, n, out, num_threads);
}

}  // namespace cvk
