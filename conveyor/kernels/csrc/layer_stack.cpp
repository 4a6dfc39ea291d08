// The decoder-layer stack of a Llama-family model in one call (cvk_llama_layers).
#include <omp.h>
#include <stdint.h>

#include <algorithm>

#include "amx.h"
#include "kernels.h"

namespace cvk {

// The decoder-layer stack of a Llama-family model for one step whose every linear layer runs here (decode-sized
// batches: T rows within the skinny GEMM's range), so a step crosses from Python into native code once for all
// layers instead of about ten times per layer (at small batches the crossings and the tensors they allocate cost
// as much as the GEMMs). Per layer, exactly the ops of the per-layer path, in its order:
//   h = rmsnorm(residual += x) (layer 0: h = rmsnorm(residual)); qkv = h Wqkv^T (+b); rope + KV write +
//   attention(qkv) -> attn; x = attn Wo^T (+b); h = rmsnorm(residual += x); gu = h Wgu^T (+b);
//   act = silu(gate) * up; x = act Wdown^T (+b)
// so the results are bit-identical to it. On entry `residual` holds the embeddings; on return `x` holds the last
// layer's output and `residual` the stream before it (the final norm stays in Python).
// Per-layer pointers come as one int64 array, field-major (fields[f * L + layer]), fields in this order:
//   0 input-norm weight, 1 qkv packed weight, 2 qkv bias (0: none), 3 o packed, 4 o bias, 5 post-norm weight,
//   6 gate_up packed, 7 gate_up bias, 8 down packed, 9 down bias, 10 k cache, 11 v cache.
// Scratch (dense, the step's dtype): h [T, hidden], qkv [T, (H + 2 KVH) D], attn [T, H D], gu [T, 2 inter],
// act [T, inter]. Weights are packed as cvk_skinny_gemm takes them; bfloat16 runs its GEMMs on AMX only
// (use_amx: the caller checked cvk_amx_init). Returns 0, or the first failing part's code (attention: -1/-2).
enum { LW_IN_NORM, LW_QKV, LW_QKV_B, LW_O, LW_O_B, LW_POST_NORM, LW_GU, LW_GU_B, LW_DOWN, LW_DOWN_B, LW_KC, LW_VC,
       LW_FIELDS };

int llama_layers(int dtype, int use_amx, int64_t T, int L, int64_t hidden, int64_t inter, const int64_t* fields,
                 void* x, void* residual, void* h, void* qkv, void* attn, void* gu, void* act,
                 const int64_t* block_table, int64_t bt_stride, const int64_t* query_start, const int64_t* seq_lens,
                 int num_reqs, const float* cos_sin, int H, int KVH, int D, int bs, float scale, float eps,
                 int num_threads) {
  if (T <= 0) return 0;
  if (dtype != 0 && dtype != 1) return -3;
  if (dtype == 1 && !kAmx) return -2;
  if (dtype == 1 && (!use_amx || hidden % 32 != 0 || inter % 32 != 0 || (int64_t(H) * D) % 32 != 0)) return -3;
  if (!attention_supports(H, KVH, D)) return -2;
  const int64_t es = dtype == 0 ? 4 : 2;
  const int64_t qkv_n = int64_t(H + 2 * KVH) * D, q_n = int64_t(H) * D;
  auto ptr = [&](int field, int layer) { return reinterpret_cast<const void*>(fields[int64_t(field) * L + layer]); };
  auto gemm = [&](const void* in, int64_t K, int layer, int wf, int bf, void* out, int64_t N) {
    if (dtype == 0)
      skinny_gemm(0, in, K, T, ptr(wf, layer), ptr(bf, layer), out, N, N, K, num_threads);
    else
      amx_gemm_bf16(static_cast<const uint16_t*>(in), K, T, static_cast<const uint16_t*>(ptr(wf, layer)),
                    static_cast<const uint16_t*>(ptr(bf, layer)), static_cast<uint16_t*>(out), N, N, K, num_threads);
  };
  auto norm = [&](const void* in, const void* w, bool add) {
    add_rmsnorm(dtype, in, hidden, residual, w, h, T, hidden, eps, add, num_threads);
  };
  char* qkv_c = static_cast<char*>(qkv);
  int rc = 0;
  // One parallel region for the whole stack: every kernel below runs on its team (on_team), separated by the
  // barriers of their loops, instead of forking and joining a team per call.
#pragma omp parallel num_threads(std::max(1, num_threads))
  for (int l = 0; l < L; l++) {
    norm(l == 0 ? residual : x, ptr(LW_IN_NORM, l), l > 0);
    gemm(h, hidden, l, LW_QKV, LW_QKV_B, qkv, qkv_n);
    const AttnArgs a{qkv_c, qkv_n, qkv_c + q_n * es, qkv_n, qkv_c + (q_n + int64_t(KVH) * D) * es, qkv_n,
                     ptr(LW_KC, l), ptr(LW_VC, l), block_table, bt_stride, query_start, seq_lens, attn, q_n,
                     H, KVH, D, bs, scale};
    const int arc = attention(dtype, a, cos_sin, num_reqs, num_threads);
    if (arc != 0) {  // the same on every thread (the inputs decide it), so the team stops together
#pragma omp atomic write
      rc = arc;
      break;
    }
    gemm(attn, q_n, l, LW_O, LW_O_B, x, hidden);
    norm(x, ptr(LW_POST_NORM, l), true);
    if (dtype == 0) {
      gemm(h, hidden, l, LW_GU, LW_GU_B, gu, 2 * inter);
      silu_mul(0, gu, act, T, inter, num_threads);
    } else {
      amx_gemm_bf16(static_cast<const uint16_t*>(h), hidden, T, static_cast<const uint16_t*>(ptr(LW_GU, l)),
                    static_cast<const uint16_t*>(ptr(LW_GU_B, l)), static_cast<uint16_t*>(act), inter, inter, hidden,
                    num_threads, /*swiglu=*/true);
    }
    gemm(act, inter, l, LW_DOWN, LW_DOWN_B, x, hidden);
  }
  return rc;
}

}  // namespace cvk
