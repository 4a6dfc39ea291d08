// Residual add + RMSNorm, and SiLU-and-mul (SwiGLU), in float32 arithmetic over float32 or bfloat16 rows.
#include <math.h>

#include <algorithm>

#include "bf16.h"
#include "kernels.h"
#include "team.h"
#include "vec.h"

namespace cvk {
namespace {

// Residual add + RMSNorm: h = x + residual (stored back into residual), out = rmsnorm(h) * weight.
template <typename T>
void add_rmsnorm_row(const T* x, T* res, const T* w, T* out, int64_t n, float eps, bool add) {
  const int64_t nv = n / W * W;
  V ss = V::zero();
  float tail_ss = 0.f;
  // First pass: h (rounded to T, as a separate add would store it), sum of squares of the rounded h.
  if (add) {
    for (int64_t i = 0; i < nv; i += W) {
      V h = V::load(x + i) + V::load(res + i);
      h.store(res + i);
      V hr = V::load(res + i);
      ss = V::fma(hr, hr, ss);
    }
    for (int64_t i = nv; i < n; i++) {
      from_f32(to_f32(x[i]) + to_f32(res[i]), res + i);
      const float h = to_f32(res[i]);
      tail_ss += h * h;
    }
  } else {
    for (int64_t i = 0; i < nv; i += W) {
      V h = V::load(x + i);
      ss = V::fma(h, h, ss);
    }
    for (int64_t i = nv; i < n; i++) tail_ss += to_f32(x[i]) * to_f32(x[i]);
  }
  const T* h = add ? res : x;
  const float inv = 1.f / sqrtf((ss.sum() + tail_ss) / float(n) + eps);
  const V vinv = V::set1(inv);
  for (int64_t i = 0; i < nv; i += W) {
    // Normalised h rounded to T first, then times the weight: the order HF's RMSNorm computes in.
    V y = V::load(h + i) * vinv;
    if (sizeof(T) == 2) {
      y.store(out + i);
      y = V::load(out + i);
    }
    (y * V::load(w + i)).store(out + i);
  }
  for (int64_t i = nv; i < n; i++) {
    float y = to_f32(h[i]) * inv;
    if (sizeof(T) == 2) {
      T t;
      from_f32(y, &t);
      y = to_f32(t);
    }
    from_f32(y * to_f32(w[i]), out + i);
  }
}

template <typename T>
void add_rmsnorm_impl(const void* x, int64_t x_stride, void* res, const void* w, void* out, int64_t rows,
                      int64_t n, float eps, bool add, int num_threads) {
  const int threads = rows * n < (1 << 15) ? 1 : std::max(1, num_threads);
  on_team(threads, [&] {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
      add_rmsnorm_row<T>(static_cast<const T*>(x) + r * x_stride, static_cast<T*>(res) + r * n,
                         static_cast<const T*>(w), static_cast<T*>(out) + r * n, n, eps, add);
  });
}

// RMSNorm in place of each token's `heads` rows of D values (rmsnorm_heads).
template <typename T>
void rmsnorm_heads_impl(void* x, int64_t token_stride, int64_t tokens, int heads, int D, const void* w, float eps,
                        int num_threads) {
  const int64_t rows = tokens * heads;
  const int threads = rows * D < (1 << 15) ? 1 : std::max(1, num_threads);
  on_team(threads, [&] {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      T* row = static_cast<T*>(x) + (r / heads) * token_stride + (r % heads) * int64_t(D);
      add_rmsnorm_row<T>(row, nullptr, static_cast<const T*>(w), row, D, eps, false);
    }
  });
}

// SwiGLU on a fused gate_up projection: out[r, i] = silu(gate[r, i]) * up[r, i].
template <typename T>
void silu_mul_impl(const void* gu, void* out, int64_t rows, int64_t n, int num_threads) {
  const int threads = rows * n < (1 << 15) ? 1 : std::max(1, num_threads);
  const int64_t nv = n / W * W;
  on_team(threads, [&] {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      const T* g = static_cast<const T*>(gu) + r * 2 * n;
      const T* u = g + n;
      T* o = static_cast<T*>(out) + r * n;
      const V one = V::set1(1.f);
      for (int64_t i = 0; i < nv; i += W) {
        V x = V::load(g + i);
        V s = x * V::rcp(one + V::exp(V::zero() - x));
        (s * V::load(u + i)).store(o + i);
      }
      for (int64_t i = nv; i < n; i++) {
        const float x = to_f32(g[i]);
        from_f32(x / (1.f + expf(-x)) * to_f32(u[i]), o + i);
      }
    }
  });
}

}  // namespace

void add_rmsnorm(int dtype, const void* x, int64_t x_stride, void* res, const void* w, void* out, int64_t rows,
                 int64_t n, float eps, bool add, int num_threads) {
  if (dtype == 0) add_rmsnorm_impl<float>(x, x_stride, res, w, out, rows, n, eps, add, num_threads);
  else add_rmsnorm_impl<uint16_t>(x, x_stride, res, w, out, rows, n, eps, add, num_threads);
}

void rmsnorm_heads(int dtype, void* x, int64_t token_stride, int64_t T, int heads, int D, const void* w, float eps,
                   int num_threads) {
  if (dtype == 0) rmsnorm_heads_impl<float>(x, token_stride, T, heads, D, w, eps, num_threads);
  else rmsnorm_heads_impl<uint16_t>(x, token_stride, T, heads, D, w, eps, num_threads);
}

void silu_mul(int dtype, const void* gu, void* out, int64_t rows, int64_t n, int num_threads) {
  if (dtype == 0) silu_mul_impl<float>(gu, out, rows, n, num_threads);
  else silu_mul_impl<uint16_t>(gu, out, rows, n, num_threads);
}

}  // namespace cvk
