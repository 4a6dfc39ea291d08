/* The C ABI of conveyor's CPU kernels: one argument struct per big call, its error codes, its version.
 *
 * conveyor/kernels/cpu_ops.py mirrors each struct as a ctypes.Structure and, when it loads a library, checks
 * the mirror field by field (name, offset, size) against cvk_struct_layout() and the version against
 * cvk_abi_version(): a reordered, retyped or missing field fails the load instead of passing garbage. Edit a
 * struct here, bump CVK_ABI_VERSION and the static_assert, and change the mirror with it. */
#ifndef CVK_H
#define CVK_H

#include <stdint.h>

#define CVK_ABI_VERSION 5

enum {
  CVK_OK = 0,
  CVK_ERR_NOMEM = -1,        /* out of memory */
  CVK_ERR_UNSUPPORTED = -2,  /* this build does not serve the shape (head size, group size) or dtype */
  CVK_ERR_BADARG = -3,       /* a bad dtype, shape, or a plan built for other arguments */
};

enum { CVK_F32 = 0, CVK_BF16 = 1 }; /* dtype codes; bfloat16 is stored as uint16_t, all arithmetic is float32 */

/* Rope (when cos_sin is not NULL) + KV-cache write + causal attention for every request of a step.
 *   q [T, q_stride] holds H heads of D values per token, k [T, k_stride] and v [T, v_stride] KVH heads each
 *     (they may be views of one fused qkv buffer); q and k are rotated in place. Request r owns tokens
 *     [query_start[r], query_start[r+1]) at positions seq_lens[r] - n_r ... seq_lens[r] - 1, and their K/V go
 *     to the slots its block table gives.
 *   k_cache, v_cache [num_blocks, KVH, bs, D] (head-major blocks); block_table [num_reqs, bt_stride]; cos_sin
 *     [positions, D] float32 (cos in the first half of a row, sin in the second); out [T, out_stride] gets H * D
 *     per token.
 *   plan: the step's work plan from cvk_attention_plan (the same for every layer), or NULL to plan in the call. */
typedef struct CvkAttnArgs {
  void* q;
  void* k;
  const void* v;
  void* k_cache;
  void* v_cache;
  const int64_t* block_table;
  const int64_t* query_start;
  const int64_t* seq_lens;
  const float* cos_sin;
  void* out;
  const void* plan;
  int64_t q_stride, k_stride, v_stride, bt_stride, out_stride;
  int32_t dtype, num_reqs, H, KVH, D, bs, num_threads;
  float scale;
} CvkAttnArgs;

/* The decoder-layer stack of a Llama-family model for one decode-sized step (cvk_llama_layers; see
 * layer_stack.cpp for the ops and their order). fields: per-layer pointers, int64 [LW_FIELDS][L] field-major
 * (layer_stack.cpp's enum gives the order); x, residual and the scratch buffers h, qkv, attn, gu, act are dense
 * [T, ...] in the step's dtype; block_table .. plan as in CvkAttnArgs. use_amx: the caller checked cvk_amx_init
 * (bfloat16 needs it). */
typedef struct CvkLayerStackArgs {
  const int64_t* fields;
  void* x;
  void* residual;
  void* h;
  void* qkv;
  void* attn;
  void* gu;
  void* act;
  const int64_t* block_table;
  const int64_t* query_start;
  const int64_t* seq_lens;
  const float* cos_sin;
  const void* plan;
  int64_t T, hidden, inter, bt_stride;
  int32_t dtype, use_amx, L, num_reqs, H, KVH, D, bs, num_threads;
  float scale, eps;
  int32_t reserved;
} CvkLayerStackArgs;

#ifdef __cplusplus
static_assert(sizeof(void*) == 8, "the Python mirrors assume 64-bit pointers");
static_assert(sizeof(CvkAttnArgs) == 11 * 8 + 5 * 8 + 8 * 4, "CvkAttnArgs changed: bump CVK_ABI_VERSION");
static_assert(sizeof(CvkLayerStackArgs) == 13 * 8 + 4 * 8 + 12 * 4, "CvkLayerStackArgs changed: bump CVK_ABI_VERSION");
#endif

enum { CVK_STRUCT_ATTN_ARGS = 0, CVK_STRUCT_LAYER_STACK_ARGS = 1 }; /* cvk_struct_layout's `which` */

#endif /* CVK_H */
