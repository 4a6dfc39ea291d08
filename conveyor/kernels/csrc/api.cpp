// The C ABI (extern "C" only): argument checks, then the kernel families' entry points (kernels.h). Plain C
// types and no torch headers, so a build takes seconds; loaded with ctypes by conveyor/kernels/cpu_ops.py.
#include <omp.h>
#include <stdint.h>
#if defined(__linux__)
#include <sched.h>
#endif

#include <stddef.h>

#include <initializer_list>
#include <string>

#include "amx.h"
#include "attention_bf16.h"
#include "attention_common.h"
#include "cvk.h"
#include "kernels.h"
#include "vec.h"

namespace {

struct Field {
  const char* name;
  size_t offset, size;
};
#define CVK_FIELD(S, f) Field{#f, offsetof(S, f), sizeof(static_cast<S*>(nullptr)->f)}

template <class S>
std::string layout(std::initializer_list<Field> fields) {
  std::string out;
  for (const Field& f : fields)
    out += std::string(f.name) + ":" + std::to_string(f.offset) + ":" + std::to_string(f.size) + ";";
  return out + "sizeof:" + std::to_string(sizeof(S));
}

}  // namespace

extern "C" {

int cvk_abi_version() { return CVK_ABI_VERSION; }

int cvk_vector_width() { return cvk::W; }

// The largest head size the attention serves (cvk::attention_supports has the other limits).
int cvk_max_head_dim() { return cvk::MAX_D; }

// "name:offset:size;..." for each field of struct `which` (CVK_STRUCT_*), then "sizeof:N", so the Python
// mirror can be checked field by field; NULL for an unknown struct.
const char* cvk_struct_layout(int which) {
  static const std::string attn = layout<CvkAttnArgs>({
      CVK_FIELD(CvkAttnArgs, q), CVK_FIELD(CvkAttnArgs, k), CVK_FIELD(CvkAttnArgs, v),
      CVK_FIELD(CvkAttnArgs, k_cache), CVK_FIELD(CvkAttnArgs, v_cache), CVK_FIELD(CvkAttnArgs, block_table),
      CVK_FIELD(CvkAttnArgs, query_start), CVK_FIELD(CvkAttnArgs, seq_lens), CVK_FIELD(CvkAttnArgs, cos_sin),
      CVK_FIELD(CvkAttnArgs, out), CVK_FIELD(CvkAttnArgs, plan), CVK_FIELD(CvkAttnArgs, key_mass),
      CVK_FIELD(CvkAttnArgs, score_rows), CVK_FIELD(CvkAttnArgs, mass_offset), CVK_FIELD(CvkAttnArgs, rope_offset),
      CVK_FIELD(CvkAttnArgs, q_stride), CVK_FIELD(CvkAttnArgs, k_stride), CVK_FIELD(CvkAttnArgs, v_stride),
      CVK_FIELD(CvkAttnArgs, bt_stride), CVK_FIELD(CvkAttnArgs, out_stride), CVK_FIELD(CvkAttnArgs, mass_stride),
      CVK_FIELD(CvkAttnArgs, window),
      CVK_FIELD(CvkAttnArgs, dtype), CVK_FIELD(CvkAttnArgs, num_reqs),
      CVK_FIELD(CvkAttnArgs, H), CVK_FIELD(CvkAttnArgs, KVH), CVK_FIELD(CvkAttnArgs, D), CVK_FIELD(CvkAttnArgs, bs),
      CVK_FIELD(CvkAttnArgs, num_threads), CVK_FIELD(CvkAttnArgs, scale), CVK_FIELD(CvkAttnArgs, kv_dtype)});
  static const std::string stack = layout<CvkLayerStackArgs>({
      CVK_FIELD(CvkLayerStackArgs, step), CVK_FIELD(CvkLayerStackArgs, fields), CVK_FIELD(CvkLayerStackArgs, x),
      CVK_FIELD(CvkLayerStackArgs, residual), CVK_FIELD(CvkLayerStackArgs, h), CVK_FIELD(CvkLayerStackArgs, qkv),
      CVK_FIELD(CvkLayerStackArgs, attn), CVK_FIELD(CvkLayerStackArgs, gu), CVK_FIELD(CvkLayerStackArgs, act),
      CVK_FIELD(CvkLayerStackArgs, quant_scratch), CVK_FIELD(CvkLayerStackArgs, T),
      CVK_FIELD(CvkLayerStackArgs, hidden), CVK_FIELD(CvkLayerStackArgs, inter),
      CVK_FIELD(CvkLayerStackArgs, use_amx), CVK_FIELD(CvkLayerStackArgs, L), CVK_FIELD(CvkLayerStackArgs, eps),
      CVK_FIELD(CvkLayerStackArgs, quantized), CVK_FIELD(CvkLayerStackArgs, moe_scratch),
      CVK_FIELD(CvkLayerStackArgs, moe_scratch_bytes), CVK_FIELD(CvkLayerStackArgs, moe_inter),
      CVK_FIELD(CvkLayerStackArgs, E), CVK_FIELD(CvkLayerStackArgs, top_k),
      CVK_FIELD(CvkLayerStackArgs, norm_topk_prob), CVK_FIELD(CvkLayerStackArgs, qk_norm_across_heads),
      CVK_FIELD(CvkLayerStackArgs, lora), CVK_FIELD(CvkLayerStackArgs, lora_linears),
      CVK_FIELD(CvkLayerStackArgs, stop), CVK_FIELD(CvkLayerStackArgs, stop_layers)});
  static const std::string qweight = layout<CvkQuantWeight>({
      CVK_FIELD(CvkQuantWeight, qs), CVK_FIELD(CvkQuantWeight, scale), CVK_FIELD(CvkQuantWeight, offset),
      CVK_FIELD(CvkQuantWeight, super_scale), CVK_FIELD(CvkQuantWeight, next), CVK_FIELD(CvkQuantWeight, N),
      CVK_FIELD(CvkQuantWeight, K), CVK_FIELD(CvkQuantWeight, KP),
      CVK_FIELD(CvkQuantWeight, kind), CVK_FIELD(CvkQuantWeight, scale_format)});
  static const std::string qgemm = layout<CvkQuantGemmArgs>({
      CVK_FIELD(CvkQuantGemmArgs, w), CVK_FIELD(CvkQuantGemmArgs, x), CVK_FIELD(CvkQuantGemmArgs, bias),
      CVK_FIELD(CvkQuantGemmArgs, y), CVK_FIELD(CvkQuantGemmArgs, scratch), CVK_FIELD(CvkQuantGemmArgs, M),
      CVK_FIELD(CvkQuantGemmArgs, x_stride), CVK_FIELD(CvkQuantGemmArgs, y_stride),
      CVK_FIELD(CvkQuantGemmArgs, scratch_bytes), CVK_FIELD(CvkQuantGemmArgs, dtype),
      CVK_FIELD(CvkQuantGemmArgs, num_threads)});
  static const std::string moe = layout<CvkMoeArgs>({
      CVK_FIELD(CvkMoeArgs, x), CVK_FIELD(CvkMoeArgs, out), CVK_FIELD(CvkMoeArgs, logits),
      CVK_FIELD(CvkMoeArgs, experts), CVK_FIELD(CvkMoeArgs, scratch), CVK_FIELD(CvkMoeArgs, T),
      CVK_FIELD(CvkMoeArgs, x_stride), CVK_FIELD(CvkMoeArgs, hidden), CVK_FIELD(CvkMoeArgs, inter),
      CVK_FIELD(CvkMoeArgs, scratch_bytes), CVK_FIELD(CvkMoeArgs, dtype), CVK_FIELD(CvkMoeArgs, E),
      CVK_FIELD(CvkMoeArgs, top_k), CVK_FIELD(CvkMoeArgs, norm_topk_prob), CVK_FIELD(CvkMoeArgs, num_threads)});
  static const std::string lora = layout<CvkLoraArgs>({
      CVK_FIELD(CvkLoraArgs, x), CVK_FIELD(CvkLoraArgs, y), CVK_FIELD(CvkLoraArgs, a), CVK_FIELD(CvkLoraArgs, b),
      CVK_FIELD(CvkLoraArgs, rows), CVK_FIELD(CvkLoraArgs, seg_start), CVK_FIELD(CvkLoraArgs, seg_slot),
      CVK_FIELD(CvkLoraArgs, sub_cols), CVK_FIELD(CvkLoraArgs, scratch), CVK_FIELD(CvkLoraArgs, x_stride),
      CVK_FIELD(CvkLoraArgs, y_stride), CVK_FIELD(CvkLoraArgs, K), CVK_FIELD(CvkLoraArgs, N),
      CVK_FIELD(CvkLoraArgs, SR), CVK_FIELD(CvkLoraArgs, R), CVK_FIELD(CvkLoraArgs, num_segs),
      CVK_FIELD(CvkLoraArgs, num_subs), CVK_FIELD(CvkLoraArgs, dtype), CVK_FIELD(CvkLoraArgs, num_threads),
      CVK_FIELD(CvkLoraArgs, w_dtype)});
  static const std::string enc = layout<CvkEncoderAttnArgs>({
      CVK_FIELD(CvkEncoderAttnArgs, q), CVK_FIELD(CvkEncoderAttnArgs, k), CVK_FIELD(CvkEncoderAttnArgs, v),
      CVK_FIELD(CvkEncoderAttnArgs, out), CVK_FIELD(CvkEncoderAttnArgs, cu_seqlens),
      CVK_FIELD(CvkEncoderAttnArgs, q_stride), CVK_FIELD(CvkEncoderAttnArgs, k_stride),
      CVK_FIELD(CvkEncoderAttnArgs, v_stride), CVK_FIELD(CvkEncoderAttnArgs, out_stride),
      CVK_FIELD(CvkEncoderAttnArgs, dtype), CVK_FIELD(CvkEncoderAttnArgs, num_seqs), CVK_FIELD(CvkEncoderAttnArgs, H),
      CVK_FIELD(CvkEncoderAttnArgs, KVH), CVK_FIELD(CvkEncoderAttnArgs, D),
      CVK_FIELD(CvkEncoderAttnArgs, num_threads), CVK_FIELD(CvkEncoderAttnArgs, scale)});
  if (which == CVK_STRUCT_ATTN_ARGS) return attn.c_str();
  if (which == CVK_STRUCT_ENCODER_ATTN_ARGS) return enc.c_str();
  if (which == CVK_STRUCT_LORA_ARGS) return lora.c_str();
  if (which == CVK_STRUCT_LAYER_STACK_ARGS) return stack.c_str();
  if (which == CVK_STRUCT_QUANT_WEIGHT) return qweight.c_str();
  if (which == CVK_STRUCT_QUANT_GEMM_ARGS) return qgemm.c_str();
  if (which == CVK_STRUCT_MOE_ARGS) return moe.c_str();
  return nullptr;
}

// Rope + KV-cache write + causal attention of every request of a step (CvkAttnArgs in cvk.h says what each
// argument holds). Returns a CVK_* code.
int cvk_attention(const CvkAttnArgs* a) { return cvk::attention(*a); }

// The bytes of the step's attention plan for `a` (only its request and head fields are read: H, KVH, D,
// num_reqs, query_start, seq_lens, num_threads); 0 when there is nothing to plan or the shape is unsupported.
int64_t cvk_attention_plan_bytes(const CvkAttnArgs* a) { return cvk::attention_plan_bytes(*a); }

// Build the step's attention plan for `a` into buf (8-byte aligned, cvk_attention_plan_bytes(a) bytes); pass
// it as a->plan to every layer's cvk_attention of the step. Returns a CVK_* code.
int cvk_attention_plan(const CvkAttnArgs* a, void* buf, int64_t bytes) { return cvk::attention_plan(*a, buf, bytes); }

// residual <- x + residual; out <- rmsnorm(residual) * weight (add == 0: out <- rmsnorm(x) * weight).
// x rows are x_stride elements apart; residual, out and weight are dense. Returns 0, -3 for a bad dtype.
int cvk_add_rmsnorm(int dtype, const void* x, int64_t x_stride, void* residual, const void* weight, void* out,
                    int64_t rows, int64_t n, float eps, int add, int num_threads) {
  if (dtype != CVK_F32 && dtype != CVK_BF16) return CVK_ERR_BADARG;
  cvk::add_rmsnorm(dtype, x, x_stride, residual, weight, out, rows, n, eps, add != 0, num_threads);
  return CVK_OK;
}


// y[M, N] (+)= x[M, K] W^T + bias for small M, W packed by the caller into 16-column blocks (see
// skinny_gemm_impl: float32 [N/16][K][16], bfloat16 [N/16][K/2][16][2], N padded to 16 with zero columns;
// bfloat16 needs K even). bias: N values of the same dtype, or NULL. Returns 0, -3 for a bad dtype/shape.
int cvk_skinny_gemm(int dtype, const void* x, int64_t x_stride, int64_t M, const void* packed, const void* bias,
                    void* y, int64_t y_stride, int64_t N, int64_t K, int num_threads) {
  if (M <= 0 || N <= 0) return CVK_OK;
  if (dtype != CVK_F32 && !(dtype == CVK_BF16 && K % 2 == 0)) return CVK_ERR_BADARG;
  cvk::skinny_gemm(dtype, x, x_stride, M, packed, bias, y, y_stride, N, K, num_threads);
  return CVK_OK;
}


// Pin OpenMP thread i of the pool (torch's own: the same libgomp) to cpus[i], for i < n, and use n threads.
// Returns how many threads were pinned. Like vLLM's thread binding: on a shared machine an unpinned pool
// stacks its threads on one core while another process holds the other, and every barrier then waits.
int cvk_bind_threads(const int* cpus, int n) {
#if defined(__linux__)
  int pinned = 0;
#pragma omp parallel num_threads(n) reduction(+ : pinned)
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[omp_get_thread_num()], &set);
    pinned += sched_setaffinity(0, sizeof(set), &set) == 0;
  }
  return pinned;
#else
  (void)cpus;
  (void)n;
  return 0;
#endif
}

// Ask Linux for the AMX tile state (once per process; oneDNN asks the same). 1: AMX usable, 0: not.
int cvk_amx_init() {
  cvk::g_amx_granted = cvk::kAmx && cvk::amx_request_permission();
  cvk::g_amx_attention = cvk::g_amx_granted;
  return cvk::g_amx_granted ? 1 : 0;
}

// Prefill attention's QK^T on AMX (bfloat16) on or off (after cvk_amx_init granted AMX); returns the setting.
int cvk_set_amx_attention(int on) {
  cvk::g_amx_attention = cvk::g_amx_granted && on != 0;
  return cvk::g_amx_attention ? 1 : 0;
}

// Prefill attention's QK^T and PV on VDPBF16PS (bfloat16, avx512bf16 builds, wherever AMX tiles do not run them)
// on or off; returns the setting (0 below the avx512bf16 level: there is no such path).
int cvk_set_dot_attention(int on) {
  cvk::g_dot_attention = cvk::kBf16Dot && on != 0;
  return cvk::g_dot_attention ? 1 : 0;
}

// The quantized GEMM's dot products on AMX-INT8 tiles for steps of at least min_rows rows, 4-bit and 8-bit
// weights alike (0: off; -1: the measured defaults, AMX_QDOT_MIN_ROWS and AMX_QDOT_MIN_ROWS_Q8), once
// cvk_amx_init granted AMX (the caller checks that the CPU reports amx_int8). Off until called. Returns the
// 4-bit weights' row count now in force (0: off).
int cvk_set_amx_qdot(int min_rows) {
  const bool on = cvk::g_amx_granted && min_rows != 0;
  cvk::g_amx_qdot_min_rows_q4 = !on ? 0 : min_rows < 0 ? cvk::AMX_QDOT_MIN_ROWS : min_rows;
  cvk::g_amx_qdot_min_rows_q8 = !on ? 0 : min_rows < 0 ? cvk::AMX_QDOT_MIN_ROWS_Q8 : min_rows;
  return int(cvk::g_amx_qdot_min_rows_q4);
}

// The bfloat16 skinny GEMM on AMX (call cvk_amx_init first): as cvk_skinny_gemm, K a multiple of 32.
int cvk_amx_gemm(const void* x, int64_t x_stride, int64_t M, const void* packed, const void* bias, void* y,
                 int64_t y_stride, int64_t N, int64_t K, int num_threads) {
  if (!cvk::kAmx) return CVK_ERR_UNSUPPORTED;
  if (M <= 0 || N <= 0) return CVK_OK;
  if (K % 32 != 0) return CVK_ERR_BADARG;
  cvk::amx_gemm_bf16(static_cast<const uint16_t*>(x), x_stride, M, static_cast<const uint16_t*>(packed),
                     static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), y_stride, N, K, num_threads);
  return CVK_OK;
}

// out[r] <- the index of the first maximum of row r of x [rows, n] (row stride x_stride elements).
int cvk_argmax_rows(int dtype, const void* x, int64_t x_stride, int64_t rows, int64_t n, int64_t* out,
                    int num_threads) {
  if (dtype != CVK_F32 && dtype != CVK_BF16) return CVK_ERR_BADARG;
  cvk::argmax_rows(dtype, x, x_stride, rows, n, out, num_threads);
  return CVK_OK;
}

// out [rows, n] <- silu(gate_up[:, :n]) * gate_up[:, n:].
int cvk_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t n, int num_threads) {
  if (dtype != CVK_F32 && dtype != CVK_BF16) return CVK_ERR_BADARG;
  cvk::silu_mul(dtype, gate_up, out, rows, n, num_threads);
  return CVK_OK;
}

// Scratch bytes cvk_quant_gemm needs for M activation rows against a weight padded to KP, with the AMX-INT8
// setting now in force (cvk_set_amx_qdot: a step on the tiles also packs its activations there).
int64_t cvk_quant_scratch_bytes(int64_t M, int64_t KP) { return cvk::quant_scratch_bytes(M, KP); }

// y[M, N] = x[M, K] W^T (+ bias) on a quantized weight (CvkQuantGemmArgs, cvk.h). Returns a CVK_* code.
int cvk_quant_gemm(const CvkQuantGemmArgs* a) { return cvk::quant_gemm(*a); }

// out[i] <- row rows[i] of W dequantized (rows NULL: rows 0 .. count - 1), K values each, out_stride apart.
int cvk_quant_dequantize(const CvkQuantWeight* w, const int64_t* rows, int64_t count, int dtype, void* out,
                         int64_t out_stride, int num_threads) {
  return cvk::quant_dequantize(*w, rows, count, dtype, out, out_stride, num_threads);
}

// W8A8 (CVK_W8A8, gemm_w8a8.cpp): whether this build's cvk_quant_gemm runs such weights (the AVX-512 levels; AVX2
// leaves them to oneDNN's s8s8s32 GEMM between the two passes below).
int cvk_w8a8_native() { return cvk::w8a8_native() ? 1 : 0; }

// q[m, 0..K) <- round(x[m] * 127 / max |x[m]|) as int8, scale[m] <- max |x[m]| / 127, for M rows of x (dtype).
int cvk_w8a8_quantize(int dtype, const void* x, int64_t x_stride, int64_t M, int64_t K, int8_t* q, int64_t q_stride,
                      float* scale, int num_threads) {
  return cvk::w8a8_quantize(dtype, x, x_stride, M, K, q, q_stride, scale, num_threads);
}

// y[m, n] <- float(acc[m, n]) * (w_scale[n] * x_scale[m]) + bias[n] (bias NULL: none), y of dtype.
int cvk_w8a8_epilogue(int dtype, const int32_t* acc, int64_t acc_stride, int64_t M, int64_t N, const float* x_scale,
                      const float* w_scale, const void* bias, void* y, int64_t y_stride, int num_threads) {
  return cvk::w8a8_epilogue(dtype, acc, acc_stride, M, N, x_scale, w_scale, bias, y, y_stride, num_threads);
}

// Whether the integer dot products use AVX512_VNNI (VPDPBUSD) in this build.
int cvk_quant_vnni() {
#if defined(CVK_VNNI)
  return 1;
#else
  return 0;
#endif
}

// Scratch bytes cvk_moe needs for a step of T rows (with the AMX-INT8 setting now in force); -3 for a bad dtype.
int64_t cvk_moe_scratch_bytes(int64_t T, int64_t hidden, int64_t inter, int E, int top_k, int dtype) {
  if (dtype != CVK_F32 && dtype != CVK_BF16) return CVK_ERR_BADARG;
  return cvk::moe_scratch_bytes(T, hidden, inter, E, top_k, dtype);
}

// A mixture's routed MLP for one step (CvkMoeArgs, cvk.h; moe.cpp). Returns a CVK_* code.
int cvk_moe(const CvkMoeArgs* a) { return cvk::moe(*a); }

// Each row's LoRA adapter's low-rank product added to y (CvkLoraArgs, cvk.h; lora.cpp). Returns a CVK_* code.
int cvk_lora_apply(const CvkLoraArgs* a) { return cvk::lora_apply(*a); }

// Bidirectional attention over a step's packed sequences (CvkEncoderAttnArgs, cvk.h; encoder_attention.cpp).
// Returns a CVK_* code.
int cvk_encoder_attention(const CvkEncoderAttnArgs* a) { return cvk::encoder_attention(*a); }

// The decoder-layer stack of a Llama-family model for one step (layer_stack.cpp). Returns a CVK_* code.
int cvk_llama_layers(const CvkLayerStackArgs* s) { return cvk::llama_layers(*s); }

}  // extern "C"
