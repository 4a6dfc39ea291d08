// The decoder-layer stack of a Llama-family model in one call (cvk_llama_layers).
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include <algorithm>

#include "amx.h"
#include "kernels.h"

namespace cvk {

// The decoder-layer stack of a Llama-family model for one step whose every linear layer runs here (decode-sized
// batches: T rows within the skinny GEMM's range), so a step crosses from Python into native code once for all
// layers instead of about ten times per layer (at small batches the crossings and the tensors they allocate cost
// as much as the GEMMs). Per layer, exactly the ops of the per-layer path, in its order:
//   h = rmsnorm(residual += x) (layer 0: h = rmsnorm(residual)); qkv = h Wqkv^T (+b); with q/k norms (Qwen3),
//   rmsnorm of each q and k head in place; rope + KV write + attention(qkv, the layer's window) -> attn;
//   x = attn Wo^T (+b); h = rmsnorm(residual += x); gu = h Wgu^T (+b); act = silu(gate) * up; x = act Wdown^T (+b)
// or, for a mixture of experts, logits = h Wrouter^T and x = cvk_moe(h, logits) (moe.cpp),
// so the results are bit-identical to it. With LoRA adapters (s.lora) each linear's GEMM is followed by the
// segmented adapter kernel (lora.cpp) on that linear's input and output, again as the per-layer path orders it.
// On entry `residual` holds the embeddings; on return `x` holds the last layer's output and `residual` the stream
// before it (the final norm stays in Python).
// Arguments: CvkLayerStackArgs (cvk.h). Per-layer pointers come as one int64 array, field-major (fields[f * L + layer]), fields in this order:
//   0 input-norm weight, 1 qkv packed weight, 2 qkv bias (0: none), 3 o packed, 4 o bias, 5 post-norm weight,
//   6 gate_up packed, 7 gate_up bias, 8 down packed, 9 down bias, 10 q-norm weight (0: none), 11 k-norm weight,
//   12 the layer's sliding window (a number, 0: none), 13 a mixture's router weight packed for the float32 skinny
//   GEMM (0: a dense MLP), 14 its experts' table (CvkMoeArgs.experts), 15 which linear fields hold CvkQuantWeight
//   descriptors (bit f for field f; the others hold packed float weights: llama.cpp's Q4_K_M keeps some layers in
//   Q6_K, which conveyor holds in float), 16 k cache, 17 v cache.
// With s.qk_norm_across_heads the q and k norms span all heads' rows (OLMoE), one row of H * D and one of KVH * D.
// Scratch (dense, the step's dtype): h [T, hidden], qkv [T, (H + 2 KVH) D], attn [T, H D], gu [T, 2 inter],
// act [T, inter]. Weights are packed as cvk_skinny_gemm takes them, and bfloat16 runs its GEMMs on AMX tiles
// (use_amx: the caller checked cvk_amx_init) or else on cvk_skinny_gemm's VDPBF16PS loop (the avx512bf16 level),
// either with gate_up and SiLU-and-mul fused in the GEMM's epilogue, bit-identical to the two calls; a linear
// field that points at a CvkQuantWeight descriptor (its bit in field 15) is cvk_quant_gemm's (either dtype), its
// activations quantized into s.quant_scratch (given when any field is). The attention plan is the step's
// (s.step.plan), or built here once for all layers. Returns CVK_OK, or the first failing part's code.
enum { LW_IN_NORM, LW_QKV, LW_QKV_B, LW_O, LW_O_B, LW_POST_NORM, LW_GU, LW_GU_B, LW_DOWN, LW_DOWN_B, LW_Q_NORM,
       LW_K_NORM, LW_WINDOW, LW_ROUTER, LW_EXPERTS, LW_QUANT, LW_KC, LW_VC, LW_FIELDS };

int llama_layers(const CvkLayerStackArgs& s) {
  const int dtype = s.step.dtype, L = s.L, H = s.step.H, KVH = s.step.KVH, D = s.step.D;
  const int num_threads = s.step.num_threads;
  const int64_t T = s.T, hidden = s.hidden, inter = s.inter;
  const int64_t* fields = s.fields;
  void *x = s.x, *residual = s.residual, *h = s.h, *attn = s.attn, *gu = s.gu, *act = s.act;
  const float eps = s.eps;
  if (T <= 0) return CVK_OK;
  if (dtype != CVK_F32 && dtype != CVK_BF16) return CVK_ERR_BADARG;
  auto is_quant = [&](int field, int layer) { return (fields[int64_t(LW_QUANT) * L + layer] >> field) & 1; };
  bool any_float = false;  // a float linear field: bfloat16 runs those on AMX tiles or VDPBF16PS dot products
  for (int l = 0; l < L; l++)
    for (int f : {LW_QKV, LW_O, LW_GU, LW_DOWN}) any_float |= fields[int64_t(f) * L + l] != 0 && !is_quant(f, l);
  if (s.quantized != 0 && s.quant_scratch == nullptr) return CVK_ERR_BADARG;
  // bfloat16 float weights: on AMX tiles (use_amx) or on the VDPBF16PS skinny GEMM (Zen 4/5, Cooper Lake: the
  // avx512bf16 level); lower levels would run the emulated bfloat16 loop, slower than oneDNN: not served.
  const bool bf16_float = dtype == CVK_BF16 && any_float, bf16_amx = bf16_float && s.use_amx;
  if (bf16_float && !(bf16_amx ? kAmx : kBf16Dot)) return CVK_ERR_UNSUPPORTED;
  if (bf16_amx && (hidden % 32 != 0 || inter % 32 != 0 || (int64_t(H) * D) % 32 != 0)) return CVK_ERR_BADARG;
  if (bf16_float && (hidden % 2 != 0 || inter % 2 != 0 || (int64_t(H) * D) % 2 != 0))
    return CVK_ERR_BADARG;  // the packed pairs of k
  if (!attention_supports(H, KVH, D)) return CVK_ERR_UNSUPPORTED;
  if (s.lora != nullptr && (s.E > 0 || s.lora_linears == nullptr)) return CVK_ERR_BADARG;  // dense models only
  if (s.E > 0 && (dtype != CVK_F32 || s.moe_scratch == nullptr ||
                  s.moe_scratch_bytes < moe_logits_bytes(T, s.E) + moe_scratch_bytes(T, hidden, s.moe_inter, s.E,
                                                                                         s.top_k, dtype)))
    return CVK_ERR_BADARG;  // a mixture's router runs on the float32 skinny GEMM
  const int64_t es = dtype == 0 ? 4 : 2;
  const int64_t qkv_n = int64_t(H + 2 * KVH) * D, q_n = int64_t(H) * D;
  auto ptr = [&](int field, int layer) { return reinterpret_cast<const void*>(fields[int64_t(field) * L + layer]); };
  auto gemm = [&](const void* in, int64_t K, int layer, int wf, int bf, void* out, int64_t N) {
    if (is_quant(wf, layer)) {
      const CvkQuantWeight* w = static_cast<const CvkQuantWeight*>(ptr(wf, layer));
      // the caller sized the scratch for the largest K
      quant_gemm_rows(w, in, K, T, ptr(bf, layer), out, N, s.quant_scratch, quant_scratch_bytes(T, w->KP), dtype,
                      num_threads);
    } else if (!bf16_amx)
      skinny_gemm(dtype, in, K, T, ptr(wf, layer), ptr(bf, layer), out, N, N, K, num_threads);
    else
      amx_gemm_bf16(static_cast<const uint16_t*>(in), K, T, static_cast<const uint16_t*>(ptr(wf, layer)),
                    static_cast<const uint16_t*>(ptr(bf, layer)), static_cast<uint16_t*>(out), N, N, K, num_threads);
  };
  // LoRA adapters (s.lora; cvk.h): after a linear's GEMM, each adapter row's low-rank product added to its
  // output by the same kernel call the per-layer path's LoRALinear makes, so adapter steps keep the one-call stack.
  enum { LL_QKV, LL_O, LL_GU, LL_DOWN, LL_LINEARS };
  auto has_lora = [&](int layer, int which) {
    return s.lora != nullptr && s.lora_linears[(int64_t(layer) * LL_LINEARS + which) * 4] != 0;
  };
  auto lora = [&](int layer, int which, const void* in, int64_t K, void* out, int64_t N) {
    if (!has_lora(layer, which)) return int(CVK_OK);
    const int64_t* e = s.lora_linears + (int64_t(layer) * LL_LINEARS + which) * 4;
    CvkLoraArgs a = *s.lora;
    a.x = in;
    a.y = out;
    a.a = reinterpret_cast<const void*>(e[0]);
    a.b = reinterpret_cast<const void*>(e[1]);
    a.sub_cols = reinterpret_cast<const int64_t*>(e[2]);
    a.num_subs = e[3];
    a.SR = a.R * a.num_subs;
    a.x_stride = a.K = K;
    a.y_stride = a.N = N;
    a.dtype = dtype;
    a.num_threads = num_threads;
    return lora_apply(a);  // on this region's team (on_team); its checks depend on the inputs only
  };
  auto norm = [&](const void* in, const void* w, bool add) {
    add_rmsnorm(dtype, in, hidden, residual, w, h, T, hidden, eps, add, num_threads);
  };
  char* qkv_c = static_cast<char*>(s.qkv);
  // What every layer's attention call shares (s.step); each layer adds its q/k/v/cache pointers.
  AttnArgs base = s.step;
  base.q_stride = base.k_stride = base.v_stride = qkv_n;
  base.out_stride = q_n;
  void* own_plan = nullptr;
  if (base.plan == nullptr && base.num_reqs > 0) {
    const int64_t bytes = attention_plan_bytes(base);
    own_plan = malloc(size_t(bytes));
    if (own_plan == nullptr) return CVK_ERR_NOMEM;
    attention_plan(base, own_plan, bytes);
    base.plan = own_plan;
  }
  int rc = 0;
  // One parallel region for the whole stack: every kernel below runs on its team (on_team), separated by the
  // barriers of their loops, instead of forking and joining a team per call.
#pragma omp parallel num_threads(std::max(1, num_threads))
  for (int l = 0; l < L; l++) {
    if (s.stop != nullptr && l > 0 && l < s.stop_layers) {  // a step the caller may cut: one read for the team
      int stop_now = 0;
#pragma omp single copyprivate(stop_now)
      stop_now = __atomic_load_n(s.stop, __ATOMIC_RELAXED);
      if (stop_now != 0) {
#pragma omp atomic write
        rc = CVK_STOPPED;
        break;
      }
    }
    norm(l == 0 ? residual : x, ptr(LW_IN_NORM, l), l > 0);
    gemm(h, hidden, l, LW_QKV, LW_QKV_B, s.qkv, qkv_n);
    int lrc = lora(l, LL_QKV, h, hidden, s.qkv, qkv_n);
    if (ptr(LW_Q_NORM, l) != nullptr && s.qk_norm_across_heads) {  // one row of all heads each, as per layer
      rmsnorm_heads(dtype, s.qkv, qkv_n, T, 1, H * D, ptr(LW_Q_NORM, l), eps, num_threads);
      rmsnorm_heads(dtype, qkv_c + q_n * es, qkv_n, T, 1, KVH * D, ptr(LW_K_NORM, l), eps, num_threads);
    } else if (ptr(LW_Q_NORM, l) != nullptr) {  // the per-layer path's rows of head_dim, the same row kernel
      rmsnorm_heads(dtype, s.qkv, qkv_n, T, H, D, ptr(LW_Q_NORM, l), eps, num_threads);
      rmsnorm_heads(dtype, qkv_c + q_n * es, qkv_n, T, KVH, D, ptr(LW_K_NORM, l), eps, num_threads);
    }
    AttnArgs a = base;
    a.window = fields[int64_t(LW_WINDOW) * L + l];
    a.q = qkv_c;
    a.k = qkv_c + q_n * es;
    a.v = qkv_c + (q_n + int64_t(KVH) * D) * es;
    a.k_cache = const_cast<void*>(ptr(LW_KC, l));
    a.v_cache = const_cast<void*>(ptr(LW_VC, l));
    a.out = attn;
    const int arc = attention(a);
    if (arc != 0) {  // the same on every thread (the inputs decide it), so the team stops together
#pragma omp atomic write
      rc = arc;
      break;
    }
    gemm(attn, q_n, l, LW_O, LW_O_B, x, hidden);
    lrc = lrc != 0 ? lrc : lora(l, LL_O, attn, q_n, x, hidden);
    norm(x, ptr(LW_POST_NORM, l), true);
    if (ptr(LW_ROUTER, l) != nullptr) {  // a mixture: the router's logits, then the experts they choose
      float* logits = static_cast<float*>(s.moe_scratch);
      skinny_gemm(0, h, hidden, T, ptr(LW_ROUTER, l), nullptr, logits, s.E, s.E, hidden, num_threads);
      CvkMoeArgs m{};
      m.x = h;
      m.out = x;
      m.logits = logits;
      m.experts = reinterpret_cast<const int64_t*>(ptr(LW_EXPERTS, l));
      m.scratch = static_cast<char*>(s.moe_scratch) + moe_logits_bytes(T, s.E);
      m.scratch_bytes = s.moe_scratch_bytes - moe_logits_bytes(T, s.E);
      m.T = T;
      m.x_stride = hidden;
      m.hidden = hidden;
      m.inter = s.moe_inter;
      m.dtype = dtype;
      m.E = s.E;
      m.top_k = s.top_k;
      m.norm_topk_prob = s.norm_topk_prob;
      m.num_threads = num_threads;
      const int mrc = moe(m);
      if (mrc != 0) {
#pragma omp atomic write
        rc = mrc;
        break;
      }
      continue;
    }
    // fused as on AMX below (a gate_up with adapters runs unfused: gate_up, its adapters, then act)
    if (bf16_float && !bf16_amx && !is_quant(LW_GU, l) && !has_lora(l, LL_GU) && inter % NBLK == 0) {
      skinny_gemm_bf16dot(static_cast<const uint16_t*>(h), hidden, T, static_cast<const uint16_t*>(ptr(LW_GU, l)),
                          static_cast<const uint16_t*>(ptr(LW_GU_B, l)), static_cast<uint16_t*>(act), inter, inter,
                          hidden, num_threads, /*swiglu=*/true);
    } else if (!bf16_amx || is_quant(LW_GU, l) || has_lora(l, LL_GU)) {
      gemm(h, hidden, l, LW_GU, LW_GU_B, gu, 2 * inter);
      lrc = lrc != 0 ? lrc : lora(l, LL_GU, h, hidden, gu, 2 * inter);
      silu_mul(dtype, gu, act, T, inter, num_threads);
    } else {
      amx_gemm_bf16(static_cast<const uint16_t*>(h), hidden, T, static_cast<const uint16_t*>(ptr(LW_GU, l)),
                    static_cast<const uint16_t*>(ptr(LW_GU_B, l)), static_cast<uint16_t*>(act), inter, inter, hidden,
                    num_threads, /*swiglu=*/true);
    }
    gemm(act, inter, l, LW_DOWN, LW_DOWN_B, x, hidden);
    lrc = lrc != 0 ? lrc : lora(l, LL_DOWN, act, inter, x, hidden);
    if (lrc != 0) {  // a bad LoRA argument: the same on every thread, so the team stops together
#pragma omp atomic write
      rc = lrc;
      break;
    }
  }
  free(own_plan);
  return rc;
}

}  // namespace cvk
