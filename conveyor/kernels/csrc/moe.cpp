// The routed MLP of a mixture of experts for one step (cvk_moe; CvkMoeArgs in cvk.h): routing, the step's choices
// grouped by expert, and each chosen expert's gate_up and down GEMMs run once on its block of rows.
//
//   per token t: p = softmax(logits[t]) over E experts; its top_k largest pick the experts (ties: the lower id),
//     their weights p (divided by their sum when norm_topk_prob)
//   per expert e, in increasing e, when any token chose it: its n_e rows of x gathered (tokens ascending),
//     gu = x_e W_gu^T, act = silu(gate) * up, y = act W_down^T, then out[t] += w_t,e * y[t] for its tokens
//
// An expert no token chose is never read, so a decode step of B tokens streams at most B * top_k experts'
// weights, not E (docs/moe.md). The per-expert order is transformers' (it adds expert outputs in increasing
// expert id), and every product and sum is rounded as torch's index_add_ of (y * w) rounds it, so the torch loop
// of conveyor/models/moe.py and this kernel agree given the same routing. Runs on its own team, or on the caller's
// (inside cvk_llama_layers' parallel region: on_team).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "bf16.h"
#include "kernels.h"
#include "team.h"

namespace cvk {
namespace {

constexpr int64_t kAlign = 64;
inline int64_t aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
inline int64_t padded32(int64_t k) { return (k + 31) / 32 * 32; }

// The scratch regions, in order (each 64-byte aligned): the top-k choices [T * top_k] (expert, weight), per expert
// its count and first row [E + 1], the grouped rows [T * top_k] (token, weight), then one expert's gathered x
// [T, hidden], gate_up [T, 2 inter], act [T, inter] and y [T, hidden] in the step's dtype, and the quantized
// GEMM's activation scratch for T rows of the wider input.
struct Scratch {
  int32_t* choice_expert;
  float* choice_weight;
  int32_t* start;
  int32_t* row_token;
  float* row_weight;
  char *xg, *gu, *act, *y, *qscratch;
  int64_t qscratch_bytes, total;

  Scratch(char* base, int64_t T, int64_t hidden, int64_t inter, int E, int top_k, int64_t es) {
    const int64_t n = T * top_k;
    int64_t at = 0;
    auto take = [&](int64_t bytes) {
      char* p = base ? base + at : nullptr;
      at += aligned(bytes);
      return p;
    };
    choice_expert = reinterpret_cast<int32_t*>(take(n * 4));
    choice_weight = reinterpret_cast<float*>(take(n * 4));
    start = reinterpret_cast<int32_t*>(take(int64_t(E + 1) * 4));
    row_token = reinterpret_cast<int32_t*>(take(n * 4));
    row_weight = reinterpret_cast<float*>(take(n * 4));
    xg = take(T * hidden * es);
    gu = take(T * 2 * inter * es);
    act = take(T * inter * es);
    y = take(T * hidden * es);
    qscratch_bytes = quant_scratch_bytes(T, padded32(std::max(hidden, inter)));
    qscratch = take(qscratch_bytes);
    total = at;
  }
};

// Token t's top_k experts and their weights from its logits (module comment).
void route_token(const float* logits, int E, int top_k, bool norm, int32_t* expert, float* weight) {
  float mx = logits[0];
  for (int e = 1; e < E; e++) mx = std::max(mx, logits[e]);
  float sum = 0.f;
  for (int e = 0; e < E; e++) sum += expf(logits[e] - mx);
  float chosen = 0.f;
  for (int j = 0; j < top_k; j++) {
    int best = -1;
    for (int e = 0; e < E; e++) {
      bool taken = false;
      for (int i = 0; i < j; i++) taken |= expert[i] == e;
      if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
    }
    expert[j] = best;
    weight[j] = expf(logits[best] - mx) / sum;
    chosen += weight[j];
  }
  if (norm)
    for (int j = 0; j < top_k; j++) weight[j] /= chosen;
}

template <typename T>
void moe_impl(const CvkMoeArgs& a, const Scratch& s) {
  const int64_t T_ = a.T, hidden = a.hidden, inter = a.inter;
  const int E = a.E, top_k = a.top_k, nt = a.num_threads;
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  auto gemm = [&](int64_t w, int64_t kind, const void* in, int64_t K, int64_t M, void* y, int64_t N) {
    if (kind == CVK_MOE_QUANT) {
      quant_gemm_rows(reinterpret_cast<const CvkQuantWeight*>(w), in, K, M, nullptr, y, N, s.qscratch,
                      s.qscratch_bytes, a.dtype, nt);
    } else {
      skinny_gemm(a.dtype, in, K, M, reinterpret_cast<const void*>(w), nullptr, y, N, N, K, nt);
    }
  };
  on_team(nt, [&] {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T_; t++) {
      route_token(a.logits + t * E, E, top_k, a.norm_topk_prob != 0, s.choice_expert + t * top_k,
                  s.choice_weight + t * top_k);
      memset(out + t * hidden, 0, size_t(hidden) * sizeof(T));
    }
#pragma omp single
    {  // counting sort of the choices by expert, tokens ascending within one (implicit barrier after)
      const int64_t choices = T_ * top_k;
      memset(s.start, 0, size_t(E + 1) * 4);
      for (int64_t i = 0; i < choices; i++) s.start[s.choice_expert[i] + 1]++;
      for (int e = 0; e < E; e++) s.start[e + 1] += s.start[e];
      for (int64_t i = 0; i < choices; i++) {  // start[e] runs to expert e's end meanwhile ...
        const int32_t at = s.start[s.choice_expert[i]]++;
        s.row_token[at] = int32_t(i / top_k);
        s.row_weight[at] = s.choice_weight[i];
      }
      for (int e = E; e > 0; e--) s.start[e] = s.start[e - 1];  // ... and is shifted back to its first row
      s.start[0] = 0;
    }
    T* xg = reinterpret_cast<T*>(s.xg);
    T* yv = reinterpret_cast<T*>(s.y);
    for (int e = 0; e < E; e++) {
      const int64_t first = s.start[e], n = s.start[e + 1] - first;
      if (n == 0) continue;
      const int64_t* w = a.experts + int64_t(e) * 4;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; i++)
        memcpy(xg + i * hidden, x + int64_t(s.row_token[first + i]) * a.x_stride, size_t(hidden) * sizeof(T));
      gemm(w[0], w[1], xg, hidden, n, s.gu, 2 * inter);
      silu_mul(a.dtype, s.gu, s.act, n, inter, nt);
      gemm(w[2], w[3], s.act, inter, n, yv, hidden);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; i++) {  // tokens differ between rows: no two threads write one row
        T wt;
        from_f32(s.row_weight[first + i], &wt);  // the weight in x's dtype, as the routers hand it on
        const float wf = to_f32(wt);
        T* o = out + int64_t(s.row_token[first + i]) * hidden;
        const T* yr = yv + i * hidden;
        for (int64_t c = 0; c < hidden; c++) {
          T prod;
          from_f32(to_f32(yr[c]) * wf, &prod);
          from_f32(to_f32(o[c]) + to_f32(prod), o + c);
        }
      }
    }
  });
}

bool valid(const CvkMoeArgs& a) {
  if (a.x == nullptr || a.out == nullptr || a.logits == nullptr || a.experts == nullptr || a.scratch == nullptr)
    return false;
  if (a.E <= 0 || a.top_k <= 0 || a.top_k > a.E || a.hidden <= 0 || a.inter <= 0 || a.x_stride < a.hidden)
    return false;
  for (int e = 0; e < a.E; e++)
    for (int part = 0; part < 2; part++) {
      const int64_t w = a.experts[e * 4 + 2 * part], kind = a.experts[e * 4 + 2 * part + 1];
      if (w == 0 || (kind != CVK_MOE_QUANT && kind != CVK_MOE_FLOAT)) return false;
      if (kind == CVK_MOE_FLOAT && a.dtype != CVK_F32) return false;  // float experts: the float32 skinny GEMM
    }
  return true;
}

}  // namespace

int64_t moe_scratch_bytes(int64_t T, int64_t hidden, int64_t inter, int E, int top_k, int dtype) {
  return Scratch(nullptr, T, hidden, inter, E, top_k, dtype == CVK_F32 ? 4 : 2).total;
}

int moe(const CvkMoeArgs& a) {
  if (a.T <= 0) return CVK_OK;
  if ((a.dtype != CVK_F32 && a.dtype != CVK_BF16) || !valid(a)) return CVK_ERR_BADARG;
  const int64_t es = a.dtype == CVK_F32 ? 4 : 2;
  const Scratch s(static_cast<char*>(a.scratch), a.T, a.hidden, a.inter, a.E, a.top_k, es);
  if (a.scratch_bytes < s.total) return CVK_ERR_BADARG;
  if (a.dtype == CVK_F32)
    moe_impl<float>(a, s);
  else
    moe_impl<uint16_t>(a, s);
  return CVK_OK;
}

}  // namespace cvk
