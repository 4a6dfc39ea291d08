// The kernels' internal entry points, one per kernel family, called by api.cpp (the C ABI) and
// layer_stack.cpp. dtype: 0 float32, 1 bfloat16 (stored as uint16_t); all arithmetic is float32.
#pragma once

#include <stdint.h>

#include "cvk.h"

namespace cvk {

using AttnArgs = CvkAttnArgs;

// attention.cpp: rope + KV write + attention of a step (cvk_attention), and its per-step plan. CVK_* codes.
int attention(const AttnArgs& a);
int64_t attention_plan_bytes(const AttnArgs& a);
int attention_plan(const AttnArgs& a, void* buf, int64_t bytes);
// Whether attention serves H query heads over KVH kv heads of D values (else it returns -2).
bool attention_supports(int H, int KVH, int D);
// norm_act.cpp
void add_rmsnorm(int dtype, const void* x, int64_t x_stride, void* res, const void* w, void* out, int64_t rows,
                 int64_t n, float eps, bool add, int num_threads);
void silu_mul(int dtype, const void* gu, void* out, int64_t rows, int64_t n, int num_threads);
// RMSNorm in place of `heads` rows of D values per token (token t's at x + t * token_stride), each row as
// add_rmsnorm computes it: q/k norms inside a fused qkv buffer
void rmsnorm_heads(int dtype, void* x, int64_t token_stride, int64_t T, int heads, int D, const void* w, float eps,
                   int num_threads);
// argmax.cpp
void argmax_rows(int dtype, const void* x, int64_t x_stride, int64_t rows, int64_t n, int64_t* out, int num_threads);
// gemm_skinny.cpp: y = x W^T + bias, W packed (cvk_skinny_gemm) in blocks of NBLK output columns
constexpr int NBLK = 16;
void skinny_gemm(int dtype, const void* x, int64_t x_stride, int64_t M, const void* wp, const void* bias, void* y,
                 int64_t y_stride, int64_t N, int64_t K, int num_threads);
// gemm_bf16dot.cpp: the bfloat16 skinny GEMM on VDPBF16PS (skinny_gemm's bfloat16 at the avx512bf16 level; swiglu:
// y = silu(gate) * up of a fused gate_up weight, N the gate's columns, N % 16 == 0); a stub below that level,
// never called there.
void skinny_gemm_bf16dot(const uint16_t* x, int64_t x_stride, int64_t M, const uint16_t* wp, const uint16_t* bias,
                         uint16_t* y, int64_t y_stride, int64_t N, int64_t K, int num_threads, bool swiglu = false);
// gemm_amx.cpp: the bfloat16 skinny GEMM on AMX tiles (swiglu: y = silu(gate) * up of a fused gate_up weight);
// a stub below the avx512bf16 level, never called there.
void amx_gemm_bf16(const uint16_t* x, int64_t x_stride, int64_t M, const uint16_t* wp, const uint16_t* bias,
                   uint16_t* y, int64_t y_stride, int64_t N, int64_t K, int num_threads, bool swiglu = false);
// gemm_quant.cpp: y = x W^T + bias on a quantized weight (cvk_quant_gemm), and its dequantization
int64_t quant_row_bytes(int64_t KP);  // scratch bytes per activation row of a weight padded to KP
int64_t quant_scratch_bytes(int64_t M, int64_t KP);  // what cvk_quant_gemm needs for M rows now (cvk_quant_scratch_bytes)
// Rows from which a step takes the AMX-INT8 tiles (qdot_amx.h) by default, where the CPU has them; below, the
// VNNI loop, whose weight stream is what a step of a few rows waits on (benchmarks/gemm_quant.py --copies).
// 8-bit weights cross over sooner: the VNNI loop does twice the dot products per byte of 4-bit weights, which
// it unpacks in registers, while the tiles read either at once (docs/kernels.md).
constexpr int64_t AMX_QDOT_MIN_ROWS = 5;     // 4-bit weights (CVK_Q4)
constexpr int64_t AMX_QDOT_MIN_ROWS_Q8 = 3;  // 8-bit weights (CVK_Q8)
int quant_gemm(const CvkQuantGemmArgs& a);
// quant_gemm of M rows of x (K apart) into y (N apart) + bias (or NULL), the activations quantized into scratch
inline int quant_gemm_rows(const CvkQuantWeight* w, const void* x, int64_t K, int64_t M, const void* bias, void* y,
                           int64_t N, void* scratch, int64_t scratch_bytes, int dtype, int num_threads) {
  CvkQuantGemmArgs q{};
  q.w = w;
  q.x = x;
  q.bias = bias;
  q.y = y;
  q.scratch = scratch;
  q.M = M;
  q.x_stride = K;
  q.y_stride = N;
  q.scratch_bytes = scratch_bytes;
  q.dtype = dtype;
  q.num_threads = num_threads;
  return quant_gemm(q);
}
int quant_dequantize(const CvkQuantWeight& w, const int64_t* rows, int64_t count, int dtype, void* out,
                     int64_t out_stride, int num_threads);
// gemm_w8a8.cpp: W8A8 (CVK_W8A8: per-channel int8 weights, per-token int8 activations). w8a8_gemm is
// quant_gemm for such a weight (CVK_ERR_UNSUPPORTED where w8a8_native() is false: the AVX2 level); w8a8_quantize
// and w8a8_epilogue are the native passes around an external s8s8s32 GEMM (oneDNN's, torch._int_mm), every level.
bool w8a8_native();
int w8a8_gemm(const CvkQuantGemmArgs& a);
int w8a8_quantize(int dtype, const void* x, int64_t x_stride, int64_t M, int64_t K, int8_t* q, int64_t q_stride,
                  float* scale, int num_threads);
int w8a8_epilogue(int dtype, const int32_t* acc, int64_t acc_stride, int64_t M, int64_t N, const float* x_scale,
                  const float* w_scale, const void* bias, void* y, int64_t y_stride, int num_threads);
// moe.cpp: a mixture's routed MLP for one step (cvk_moe), and its scratch bytes
int64_t moe_scratch_bytes(int64_t T, int64_t hidden, int64_t inter, int E, int top_k, int dtype);
int moe(const CvkMoeArgs& a);
// The router logits' share at the start of the layer stack's moe_scratch: T * E floats, 64-byte aligned.
inline int64_t moe_logits_bytes(int64_t T, int E) { return (T * E * 4 + 63) / 64 * 64; }
// lora.cpp: many LoRA adapters' low-rank products added to a step's rows (cvk_lora_apply)
int lora_apply(const CvkLoraArgs& a);
// encoder_attention.cpp: bidirectional attention over a step's packed sequences (cvk_encoder_attention)
int encoder_attention(const CvkEncoderAttnArgs& a);
// layer_stack.cpp: cvk_llama_layers
int llama_layers(const CvkLayerStackArgs& s);
}  // namespace cvk
