// The C ABI (extern "C" only): argument checks, then the kernel families' entry points (kernels.h). Plain C
// types and no torch headers, so a build takes seconds; loaded with ctypes by conveyor/kernels/cpu_ops.py.
#include <omp.h>
#include <stdint.h>
#if defined(__linux__)
#include <sched.h>
#endif

#include "amx.h"
#include "kernels.h"
#include "vec.h"

extern "C" {

int cvk_abi_version() { return 4; }

int cvk_vector_width() { return cvk::W; }

// Rope (when cos_sin is not NULL) + KV-cache write + causal attention for every request of a step.
//   q [T, q_stride] holds H heads of D values per token, k [T, k_stride] and v [T, v_stride] KVH heads each
//     (they may be views of one fused qkv buffer); q and k are rotated in place. Request r owns tokens
//     [query_start[r], query_start[r+1]) at positions seq_lens[r] - n_r ... seq_lens[r] - 1, and their K/V go
//     to the slots its block table gives.
//   k_cache, v_cache [num_blocks, KVH, bs, D] (head-major blocks); block_table [num_reqs, bt_stride]; cos_sin [positions, D]
//     (cos in the first half of a row, sin in the second); out [T, out_stride] gets H * D per token.
// Returns 0, -1 when out of memory, -2 when this build does not support the head size.
int cvk_attention(int dtype, void* q, int64_t q_stride, void* k, int64_t k_stride, const void* v, int64_t v_stride,
                  void* k_cache, void* v_cache, const int64_t* block_table, int64_t bt_stride,
                  const int64_t* query_start, const int64_t* seq_lens, int num_reqs, const float* cos_sin, void* out,
                  int64_t out_stride, int H, int KVH, int D, int bs, float scale, int num_threads) {
  if (num_reqs <= 0) return 0;
  if (!cvk::attention_supports(H, KVH, D)) return -2;
  const cvk::AttnArgs a{q, q_stride, k, k_stride, v, v_stride, k_cache, v_cache, block_table, bt_stride, query_start,
                        seq_lens, out, out_stride, H, KVH, D, bs, scale};
  return cvk::attention(dtype, a, cos_sin, num_reqs, num_threads);
}

// residual <- x + residual; out <- rmsnorm(residual) * weight (add == 0: out <- rmsnorm(x) * weight).
// x rows are x_stride elements apart; residual, out and weight are dense. Returns 0, -3 for a bad dtype.
int cvk_add_rmsnorm(int dtype, const void* x, int64_t x_stride, void* residual, const void* weight, void* out,
                    int64_t rows, int64_t n, float eps, int add, int num_threads) {
  if (dtype != 0 && dtype != 1) return -3;
  cvk::add_rmsnorm(dtype, x, x_stride, residual, weight, out, rows, n, eps, add != 0, num_threads);
  return 0;
}


// y[M, N] (+)= x[M, K] W^T + bias for small M, W packed by the caller into 16-column blocks (see
// skinny_gemm_impl: float32 [N/16][K][16], bfloat16 [N/16][K/2][16][2], N padded to 16 with zero columns;
// bfloat16 needs K even). bias: N values of the same dtype, or NULL. Returns 0, -3 for a bad dtype/shape.
int cvk_skinny_gemm(int dtype, const void* x, int64_t x_stride, int64_t M, const void* packed, const void* bias,
                    void* y, int64_t y_stride, int64_t N, int64_t K, int num_threads) {
  if (M <= 0 || N <= 0) return 0;
  if (dtype != 0 && !(dtype == 1 && K % 2 == 0)) return -3;
  cvk::skinny_gemm(dtype, x, x_stride, M, packed, bias, y, y_stride, N, K, num_threads);
  return 0;
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
  cvk::g_amx_attention = cvk::kAmx && cvk::amx_request_permission();
  return cvk::g_amx_attention ? 1 : 0;
}

// Prefill attention's QK^T on AMX (bfloat16) on or off (after cvk_amx_init granted AMX); returns the setting.
int cvk_set_amx_attention(int on) {
  static const bool granted = cvk::g_amx_attention;  // the first call remembers what cvk_amx_init obtained
  cvk::g_amx_attention = granted && on != 0;
  return cvk::g_amx_attention ? 1 : 0;
}

// The bfloat16 skinny GEMM on AMX (call cvk_amx_init first): as cvk_skinny_gemm, K a multiple of 32.
int cvk_amx_gemm(const void* x, int64_t x_stride, int64_t M, const void* packed, const void* bias, void* y,
                 int64_t y_stride, int64_t N, int64_t K, int num_threads) {
  if (!cvk::kAmx) return -2;
  if (M <= 0 || N <= 0) return 0;
  if (K % 32 != 0) return -3;
  cvk::amx_gemm_bf16(static_cast<const uint16_t*>(x), x_stride, M, static_cast<const uint16_t*>(packed),
                     static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), y_stride, N, K, num_threads);
  return 0;
}

// out[r] <- the index of the first maximum of row r of x [rows, n] (row stride x_stride elements).
int cvk_argmax_rows(int dtype, const void* x, int64_t x_stride, int64_t rows, int64_t n, int64_t* out,
                    int num_threads) {
  if (dtype != 0 && dtype != 1) return -3;
  cvk::argmax_rows(dtype, x, x_stride, rows, n, out, num_threads);
  return 0;
}

// out [rows, n] <- silu(gate_up[:, :n]) * gate_up[:, n:].
int cvk_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t n, int num_threads) {
  if (dtype != 0 && dtype != 1) return -3;
  cvk::silu_mul(dtype, gate_up, out, rows, n, num_threads);
  return 0;
}

int cvk_llama_layers(int dtype, int use_amx, int64_t T, int L, int64_t hidden, int64_t inter,
                     const int64_t* fields, void* x, void* residual, void* h, void* qkv, void* attn,
                     void* gu, void* act, const int64_t* block_table, int64_t bt_stride,
                     const int64_t* query_start, const int64_t* seq_lens, int num_reqs, const float* cos_sin, int H,
                     int KVH, int D, int bs, float scale, float eps, int num_threads) {
  return cvk::llama_layers(dtype, use_amx, T, L, hidden, inter, fields, x, residual, h, qkv, attn, gu, act,
                           block_table, bt_stride, query_start, seq_lens, num_reqs, cos_sin, H, KVH, D, bs, scale,
                           eps, num_threads);
}

}  // extern "C"
