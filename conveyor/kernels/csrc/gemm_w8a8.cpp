// W8A8 (CVK_W8A8 in cvk.h): int8 weights with one scale per output channel against int8 activations with one
// scale per row (token), quantized when the GEMM runs, as vLLM's W8A8 (compressed-tensors, dynamic per-token
// activations) computes it: one integer product per weight, summed over the whole K in int32, then
//   y[m, n] = float(sum_k q_w[n, k] q_x[m, k]) * (w_scale[n] * x_scale[m]) + bias[n]
// (one FMA, the same function for every path, so this loop and oneDNN's s8s8s32 GEMM + w8a8_epilogue give the same
// floats for the same integers). The activations: x_scale = max |x| / 127 per row, q = round-half-even(x * 127 /
// max |x|). Three entry points: w8a8_gemm (cvk_quant_gemm for a W8A8 weight: the quantization, the VNNI loop and
// the epilogue in one parallel region: what the layer stack runs), w8a8_quantize and w8a8_epilogue (the two native
// passes around torch._int_mm for prefill-sized steps: conveyor/layers/w8a8.py picks by row count).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "bf16.h"
#include "kernels.h"
#include "qdot.h"
#include "team.h"
#include "vec.h"

namespace cvk {
namespace {

constexpr int QG = 16;  // columns per group (cvk.h's layout, CVK_Q8's bytes)

// Row m's max |x| and its int8 quantization into q[0..K), zeros in q[K..KP); returns the row's scale.
template <typename T>
float quantize_token(const T* x, int64_t K, int64_t KP, int8_t* q) {
  V m = V::zero();
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    const V v = V::load(x + k);
    m = V::max(m, V::max(v, V::zero() - v));
  }
  alignas(64) float lanes[W];
  m.store(lanes);
  float amax = 0.f;
  for (int i = 0; i < W; i++) amax = std::max(amax, lanes[i]);
  for (int64_t t = k; t < K; t++) amax = std::max(amax, fabsf(to_f32(x[t])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (k = 0; k + W <= K; k += W) (V::load(x + k) * V::set1(inv)).store_i8(q + k);
  for (; k < K; k++) q[k] = int8_t(nearbyintf(to_f32(x[k]) * inv));
  if (KP > K) memset(q + K, 0, size_t(KP - K));
  return amax / 127.f;
}

// One output row: y[c] = float(acc[c]) * (w_scale[c] * x_scale) + bias[c] for c < n (the epilogue of every path).
template <typename T>
inline void store_row(const int32_t* acc, int64_t n, float x_scale, const float* w_scale, const T* bias, T* y) {
  int64_t c = 0;
  for (; c + W <= n; c += W) {
    const V b = bias != nullptr ? V::load(bias + c) : V::zero();
    V::fma(V::load_i32(acc + c), V::load(w_scale + c) * V::set1(x_scale), b).store(y + c);
  }
  for (; c < n; c++)
    from_f32(fmaf(float(acc[c]), w_scale[c] * x_scale, bias != nullptr ? to_f32(bias[c]) : 0.f), y + c);
}

// A quantized activation row in the scratch (rb bytes a row): KP int8 values, then its scale and the sum of its
// values (to take back the 128 x sum(x) that VPDPBUSD's unsigned weights add).
struct W8a8Row {
  const int8_t* q;
  float scale;
  int32_t sum;
};
inline W8a8Row row_at(const char* scratch, int64_t rb, int64_t KP, int64_t m) {
  const char* base = scratch + m * rb;
  W8a8Row r;
  r.q = reinterpret_cast<const int8_t*>(base);
  memcpy(&r.scale, base + KP, 4);
  memcpy(&r.sum, base + KP + 4, 4);
  return r;
}

template <int R>
inline void pair_dot_upto(int r, const uint8_t* qa, const uint8_t* qb, const int8_t* const* x, int64_t nb,
                          int32_t* out_a, int32_t* out_b, bool prefetch) {
  if constexpr (R > 1) {
    if (r < R) return pair_dot_upto<R - 1>(r, qa, qb, x, nb, out_a, out_b, prefetch);
  }
  qdot::w8a8_group_dot<R>(qa, qb, x, nb, out_a, out_b, prefetch);
}

// Group g's rows m0 .. m0 + r - 1 (acc: their integer sums, 16 a row) through the epilogue into y.
template <typename T>
inline void store_group(int32_t* acc, const W8a8Row* rows, int r, int64_t g, int64_t N, const float* w_scale,
                        const T* bias, T* y, int64_t y_stride, int64_t m0) {
  const int nc = int(std::min<int64_t>(QG, N - g * QG));
  for (int i = 0; i < r; i++) {
    int32_t* ai = acc + i * QG;
    if constexpr (!qdot::kSignedQ8Dot)  // VPDPBUSD multiplied q + 128: take 128 sum(x) back
      for (int c = 0; c < QG; c++) ai[c] -= 128 * rows[i].sum;
    store_row(ai, nc, rows[i].scale, w_scale + g * QG, bias == nullptr ? nullptr : bias + g * QG,
              y + (m0 + i) * y_stride + g * QG);
  }
}

template <typename T>
void gemm_impl(const CvkQuantGemmArgs& a) {
  const int64_t M = a.M, KP = a.w->KP, K = a.w->K, nb = KP / 32, rb = quant_row_bytes(KP);
  const T* x = static_cast<const T*>(a.x);
  char* scratch = static_cast<char*>(a.scratch);
  constexpr int R = qdot::kW8a8Rows;
  on_team(a.num_threads, [&] {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
      char* row = scratch + m * rb;
      int8_t* q = reinterpret_cast<int8_t*>(row);
      const float scale = quantize_token(x + m * a.x_stride, K, KP, q);
      int32_t sum = 0;
      for (int64_t k = 0; k < K; k++) sum += q[k];
      memcpy(row + KP, &scale, 4);
      memcpy(row + KP + 4, &sum, 4);
    }
    int64_t n0 = 0;
    for (const CvkQuantWeight* part = a.w; part != nullptr; n0 += part->N, part = part->next) {
      const int64_t N = part->N, groups = (N + QG - 1) / QG, pairs = (groups + 1) / 2;
      const float* w_scale = static_cast<const float*>(part->scale);
      const T* bias = a.bias != nullptr ? static_cast<const T*>(a.bias) + n0 : nullptr;
      T* y = static_cast<T*>(a.y) + n0;
      // pairs of groups (an odd last group is paired with itself and stored once)
#pragma omp for schedule(static)
      for (int64_t p = 0; p < pairs; p++) {
        const int64_t ga = 2 * p, gb = std::min(2 * p + 1, groups - 1);
        const uint8_t* qa = static_cast<const uint8_t*>(part->qs) + ga * nb * 512;
        const uint8_t* qb = static_cast<const uint8_t*>(part->qs) + gb * nb * 512;
        for (int64_t m0 = 0; m0 < M; m0 += R) {
          const int r = int(std::min<int64_t>(R, M - m0));
          W8a8Row rows[R];
          const int8_t* xq[R];
          for (int i = 0; i < r; i++) {
            rows[i] = row_at(scratch, rb, KP, m0 + i);
            xq[i] = rows[i].q;
          }
          alignas(64) int32_t acc_a[R * QG], acc_b[R * QG];
          pair_dot_upto<R>(r, qa, qb, xq, nb, acc_a, acc_b, /*prefetch=*/m0 == 0);
          store_group(acc_a, rows, r, ga, N, w_scale, bias, y, a.y_stride, m0);
          if (gb != ga) store_group(acc_b, rows, r, gb, N, w_scale, bias, y, a.y_stride, m0);
        }
      }
    }
  });
}

template <typename T>
void quantize_impl(const T* x, int64_t x_stride, int64_t M, int64_t K, int8_t* q, int64_t q_stride, float* scale,
                   int num_threads) {
  on_team(num_threads, [&] {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) scale[m] = quantize_token(x + m * x_stride, K, K, q + m * q_stride);
  });
}

template <typename T>
void epilogue_impl(const int32_t* acc, int64_t acc_stride, int64_t M, int64_t N, const float* x_scale,
                   const float* w_scale, const T* bias, T* y, int64_t y_stride, int num_threads) {
  on_team(num_threads, [&] {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) store_row(acc + m * acc_stride, N, x_scale[m], w_scale, bias, y + m * y_stride);
  });
}

}  // namespace

bool w8a8_native() { return qdot::kW8a8Dot; }

int w8a8_gemm(const CvkQuantGemmArgs& a) {
  if (!qdot::kW8a8Dot) return CVK_ERR_UNSUPPORTED;
  if (a.dtype == CVK_F32)
    gemm_impl<float>(a);
  else if (a.dtype == CVK_BF16)
    gemm_impl<uint16_t>(a);
  else
    return CVK_ERR_BADARG;
  return CVK_OK;
}

int w8a8_quantize(int dtype, const void* x, int64_t x_stride, int64_t M, int64_t K, int8_t* q, int64_t q_stride,
                  float* scale, int num_threads) {
  if (M < 0 || K <= 0 || q_stride < K || x_stride < K) return CVK_ERR_BADARG;
  if (dtype == CVK_F32)
    quantize_impl(static_cast<const float*>(x), x_stride, M, K, q, q_stride, scale, num_threads);
  else if (dtype == CVK_BF16)
    quantize_impl(static_cast<const uint16_t*>(x), x_stride, M, K, q, q_stride, scale, num_threads);
  else
    return CVK_ERR_BADARG;
  return CVK_OK;
}

int w8a8_epilogue(int dtype, const int32_t* acc, int64_t acc_stride, int64_t M, int64_t N, const float* x_scale,
                  const float* w_scale, const void* bias, void* y, int64_t y_stride, int num_threads) {
  if (M < 0 || N <= 0 || acc_stride < N || y_stride < N) return CVK_ERR_BADARG;
  if (dtype == CVK_F32)
    epilogue_impl(acc, acc_stride, M, N, x_scale, w_scale, static_cast<const float*>(bias), static_cast<float*>(y),
                  y_stride, num_threads);
  else if (dtype == CVK_BF16)
    epilogue_impl(acc, acc_stride, M, N, x_scale, w_scale, static_cast<const uint16_t*>(bias),
                  static_cast<uint16_t*>(y), y_stride, num_threads);
  else
    return CVK_ERR_BADARG;
  return CVK_OK;
}

}  // namespace cvk
