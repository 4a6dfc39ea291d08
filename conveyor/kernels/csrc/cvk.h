/* The C ABI of conveyor's CPU kernels: one argument struct per big call, its error codes, its version.
 *
 * conveyor/kernels/cpu_ops.py mirrors each struct as a ctypes.Structure and, when it loads a library, checks
 * the mirror field by field (name, offset, size) against cvk_struct_layout() and the version against
 * cvk_abi_version(): a reordered, retyped or missing field fails the load instead of passing garbage. Edit a
 * struct here, bump CVK_ABI_VERSION and the static_assert, and change the mirror with it. */
#ifndef CVK_H
#define CVK_H

#include <stdint.h>

#define CVK_ABI_VERSION 19

enum {
  CVK_OK = 0,
  CVK_ERR_NOMEM = -1,        /* out of memory */
  CVK_ERR_UNSUPPORTED = -2,  /* this build does not serve the shape (head size, group size) or dtype */
  CVK_ERR_BADARG = -3,       /* a bad dtype, shape, or a plan built for other arguments */
  CVK_STOPPED = 1,           /* not an error: cvk_llama_layers stopped between layers at the caller's request */
};

enum { CVK_F32 = 0, CVK_BF16 = 1 }; /* dtype codes; bfloat16 is stored as uint16_t, all arithmetic is float32 */

/* KV-cache element codes (kv_dtype): CVK_KV_SAME, the cache holds the step's dtype; CVK_KV_BF16, a float32 step's
 * cache holds bfloat16 (each value rounded to nearest even as it is written, widened as it is read); CVK_KV_INT8,
 * each head's row of a token holds D int8 values then its float32 scale (4 bytes): row = D + 4 bytes. The row x
 * (after rope) is first rotated, y = H x, H the unnormalized Walsh-Hadamard transform of each block of b = D & -D
 * values (butterflies of stride 1, 2, 4, ...); then scale = max |y| / 127, q = round-half-even(y / scale) (0 for a
 * row of zeros). Reading gives y = scale * q and x = H y / b. The kernels quantize when they write a row; when they
 * read, they rotate the query and the output instead of each row (layers/attention/kv_quant.py is the same in
 * torch). */
enum { CVK_KV_SAME = 0, CVK_KV_BF16 = 1, CVK_KV_INT8 = 2 };

/* Rope (when cos_sin is not NULL) + KV-cache write + causal attention for every request of a step.
 *   q [T, q_stride] holds H heads of D values per token, k [T, k_stride] and v [T, v_stride] KVH heads each
 *     (they may be views of one fused qkv buffer); q and k are rotated in place. Request r owns tokens
 *     [query_start[r], query_start[r+1]) at positions seq_lens[r] - n_r ... seq_lens[r] - 1, and their K/V go
 *     to the slots its block table gives.
 *   k_cache, v_cache [num_blocks, KVH, bs, D] (head-major blocks), elements of the step's dtype; with kv_dtype
 *     CVK_KV_INT8 [num_blocks, KVH, bs, D + 4] bytes (the rows above); block_table [num_reqs, bt_stride]; cos_sin
 *     [positions, D] float32 (cos in the first half of a row, sin in the second); out [T, out_stride] gets H * D
 *     per token.
 *   plan: the step's work plan from cvk_attention_plan (the same for every layer), or NULL to plan in the call.
 *   rope_offset: NULL (every token's RoPE position is its KV slot), or [num_reqs] int64: request r's positions
 *     are its slots + rope_offset[r] (KV eviction dropped that many of its earlier tokens).
 *   window: 0, or the layer's sliding window: a query at slot p sees keys p - window + 1 .. p only (slots are
 *     positions then: a windowed call with rope_offset or key_mass is CVK_ERR_BADARG).
 * Attention mass for KV eviction by score, when key_mass is not NULL: for each request r with score_rows[r] > 0,
 * every one of its last score_rows[r] new tokens' H query heads adds its softmax probability of each key it sees
 * into key_mass[mass_offset[r] + kvh * mass_stride + slot] (kvh: the head's kv head), float32, accumulated (+=)
 * over calls, so one buffer sums a step's layers. mass_stride must cover each scored request's seq_len rounded up
 * to 32 (the decode loop adds whole chunks of keys; the padding gets zeros). The outputs do not change. */
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
  float* key_mass;
  const int32_t* score_rows;
  const int64_t* mass_offset;
  const int64_t* rope_offset;
  int64_t q_stride, k_stride, v_stride, bt_stride, out_stride, mass_stride, window;
  int32_t dtype, num_reqs, H, KVH, D, bs, num_threads;
  float scale;
  int32_t kv_dtype; /* CVK_KV_SAME, CVK_KV_BF16 (float32 steps only) or CVK_KV_INT8 */
} CvkAttnArgs;

/* The decoder-layer stack of a Llama-family model for one decode-sized step (cvk_llama_layers; see
 * layer_stack.cpp for the ops and their order). step: the attention arguments every layer shares, as
 * cvk_attention takes them (block_table .. rope_offset, bt_stride, mass_stride, dtype .. scale; the key mass then
 * sums every layer's); the stack fills in each layer's q, k, v, out, caches, strides and window, and step.dtype and
 * step.num_threads serve the whole stack. fields: per-layer pointers, int64 [LW_FIELDS][L] field-major
 * (layer_stack.cpp's enum gives the order); x, residual and the scratch buffers h, qkv, attn, gu, act are dense
 * [T, ...] in the step's dtype. use_amx: the caller checked cvk_amx_init (bfloat16 with float weights needs it). */
typedef struct CvkLayerStackArgs {
  CvkAttnArgs step;
  const int64_t* fields;
  void* x;
  void* residual;
  void* h;
  void* qkv;
  void* attn;
  void* gu;
  void* act;
  void* quant_scratch; /* quantized: cvk_quant_scratch_bytes(T, the largest K) bytes for the activations */
  int64_t T, hidden, inter;
  int32_t use_amx, L;
  float eps;
  int32_t quantized; /* 1: some linear fields hold CvkQuantWeight descriptors (a per-layer field says which) */
  /* A mixture of experts (E > 0; float32 only): per layer its router and experts' table (layer_stack.cpp's
   * fields), top_k and norm_topk_prob as in CvkMoeArgs, the experts' width moe_inter, and moe_scratch: the router
   * logits (T * E floats, 64-byte aligned) then cvk_moe_scratch_bytes(T, ...) for cvk_moe, moe_scratch_bytes in
   * all. qk_norm_across_heads: the q/k norms span all heads (one row of H * D, one of KVH * D per token). */
  void* moe_scratch;
  int64_t moe_scratch_bytes, moe_inter;
  int32_t E, top_k, norm_topk_prob, qk_norm_across_heads;
  /* LoRA adapters (NULL: none; dense models only): lora holds the step's segments as cvk_lora_apply takes them
   * (rows, seg_start, seg_slot, scratch for T x the largest SR floats, num_segs, R, w_dtype); lora_linears int64
   * [L][4][4], per layer and linear (qkv, o, gate_up, down): its adapters' a, b, sub_cols and num_subs (a = 0: none
   * on it). After each such linear's GEMM the stack adds the rows' low-rank products to its output, as the
   * per-layer path's LoRALinear does (layers/lora.py); a gate_up with adapters runs unfused (gate_up, then act). */
  const struct CvkLoraArgs* lora;
  const int64_t* lora_linears;
  /* A step another thread may cut short (NULL: none): before each layer l with 0 < l < stop_layers the stack
   * reads *stop (one thread, shared with the team); non-zero: it returns CVK_STOPPED, the layers after l not run
   * (the K/V of layers before l written: the caller drops the step and recomputes it whole). */
  const int32_t* stop;
  int64_t stop_layers;
} CvkLayerStackArgs;

#ifdef __cplusplus
static_assert(sizeof(void*) == 8, "the Python mirrors assume 64-bit pointers");
static_assert(sizeof(CvkAttnArgs) == 15 * 8 + 7 * 8 + 10 * 4, "CvkAttnArgs changed: bump CVK_ABI_VERSION");
static_assert(sizeof(CvkLayerStackArgs) == sizeof(CvkAttnArgs) + 9 * 8 + 3 * 8 + 4 * 4 + 3 * 8 + 4 * 4 + 2 * 8 + 2 * 8,
              "CvkLayerStackArgs changed: bump CVK_ABI_VERSION");
#endif

/* A linear layer's weight quantized in blocks of 32 values along K (gemm_quant.cpp; conveyor/layers/quantized.py
 * packs it): value = scale * q + offset per block, q unsigned. Columns (output features) come in groups of 16,
 * N padded with zero columns to NP; K is padded with zero blocks to KP (a multiple of 32). Per group g and block j:
 *   kind CVK_Q8: qs uint8 [NP/16][KP/32][8][16][4]: 8 quads of k, each 16 columns x 4 consecutive k (512 bytes);
 *   kind CVK_Q4: qs uint8 [NP/16][KP/32][4][16][4]: byte (u, i, b) = q(i, 32j + 8u + b) | q(i, 32j + 8u + 4 + b) << 4
 *                (the low nibbles are quad 2u, the high ones quad 2u + 1; 256 bytes);
 *   kind CVK_Q5: qs uint8 [NP/16][KP/32][320]: q's low 4 bits as CVK_Q4 lays them (256 bytes), then 64 bytes:
 *                bit t of byte 256 + 4i + b = q's fifth bit of (column i, k = 32j + 4t + b) (Q5_0, Q5_1, Q5_K:
 *                0.625 bytes a value, the file's 5 bits);
 *   scale, offset [NP/16][KP/32][16]: float32 (scale_format CVK_SCALE_F32), IEEE halves (uint16 bits,
 *                CVK_SCALE_F16), or K-quant sub-scales (CVK_SCALE_KQUANT: uint8 sc and m per block, with
 *                super_scale f16 [NP/16][KP/256][2][16], each column's d then dmin per 256 values along K:
 *                scale = d * sc, offset = -dmin * m, exact in float32; KP a multiple of 256); offset NULL
 *                when every block's offset is q's middle times its scale (-128 * scale for CVK_Q8, -8 * scale
 *                for CVK_Q4, -16 * scale for CVK_Q5: Q8_0, int8, Q4_0, Q5_0), which the kernels compute.
 * So one 64-byte load is 16 columns x 4 k, a VPDPBUSD against 4 broadcast activation bytes. Signed formats
 * (Q8_0, int8) are stored as q + 128 with the offset taking -128 * scale. Halves hold the formats whose scale and
 * offset are one f16 per block in the file (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: the weight stream is then the file's
 * bytes, Q8_0 and Q4_0 storing no offsets); Q4_K and Q5_K keep the file's f16 d and dmin per 256 values and a
 * byte per 6-bit sub-scale (0.578 bytes a value for Q4_K, against the file's 0.5625); int8 (max / 127) needs
 * float32.
 *   kind CVK_Q6 (Q6_K: value = super * sub * (q - 32), q 6-bit, one int8 sub-scale per 16 values along K and one
 *                f16 super-scale per 256; KP a multiple of 256): qs uint8 [NP/16][KP/32][384]: bytes 0..255 q's
 *                low 4 bits as CVK_Q4 lays them, then byte 256 + 64 v + 4 i + b holds bits 2t..2t+1 = q's high 2
 *                bits of (column i, k = 32j + 4(4v + t) + b), t = 0..3; scale int8 [NP/16][KP/16][16] the
 *                sub-scales; super_scale f16 [NP/16][KP/256][16]; offset NULL, scale_format 0. The weight stream is
 *                then the file's bytes (0.8203 a value).
 *   kind CVK_W8A8 (W8A8, as vLLM's compressed-tensors checkpoints: per-channel int8 weights against per-token int8
 *                activations; gemm_w8a8.cpp): qs as CVK_Q8 lays them (q + 128, q in [-127, 127]); scale float32
 *                [NP], one per column (scale_format CVK_SCALE_F32); offset and super_scale NULL; KP < 65536. The
 *                activations are quantized per row, the integer sums run over the whole K; a chain is all W8A8.
 * next: NULL, or the weight of the rows that follow this one's N (output columns N, N + 1, ...) with the same K
 * and KP, in whatever kind: one linear whose row parts came in different types (a Q6_K attn_v after Q4_K q and
 * k), computed by one call into one output. */
enum { CVK_Q4 = 1, CVK_Q8 = 2, CVK_Q6 = 3, CVK_W8A8 = 4, CVK_Q5 = 5 };
enum { CVK_SCALE_F32 = 0, CVK_SCALE_F16 = 1, CVK_SCALE_KQUANT = 2 };
typedef struct CvkQuantWeight {
  const void* qs;
  const void* scale;
  const void* offset;
  const void* super_scale;
  const struct CvkQuantWeight* next;
  int64_t N, K, KP;
  int32_t kind, scale_format;
} CvkQuantWeight;

/* y[M, N] = x[M, K] W^T (+ bias) for a CvkQuantWeight W: x (dtype) is quantized per block of 32 to int8 into
 * scratch (cvk_quant_scratch_bytes), then integer dot products per block, scaled, summed in float32. */
typedef struct CvkQuantGemmArgs {
  const CvkQuantWeight* w;
  const void* x;
  const void* bias; /* N values of dtype, or NULL */
  void* y;
  void* scratch;
  int64_t M, x_stride, y_stride, scratch_bytes;
  int32_t dtype, num_threads;
} CvkQuantGemmArgs;

/* The routed MLP of a mixture of experts for one step (cvk_moe, moe.cpp): per token, softmax over the E router
 * logits, the top_k largest (divided by their sum when norm_topk_prob), then each chosen expert's gate_up and down
 * GEMMs once on the rows of the tokens that chose it, out = the weighted sum in increasing expert order.
 *   x [T, x_stride] (dtype): the normed hidden states; out [T, hidden] (dtype), written; logits [T, E] float32.
 *   experts: int64 [E][4] = (gate_up weight, its kind, down weight, its kind), kind CVK_MOE_QUANT (a
 *     CvkQuantWeight*, either dtype) or CVK_MOE_FLOAT (packed for cvk_skinny_gemm, float32 only); no biases.
 *   scratch: cvk_moe_scratch_bytes(T, hidden, inter, E, top_k, dtype) bytes (with the AMX-INT8 setting in force). */
enum { CVK_MOE_FLOAT = 0, CVK_MOE_QUANT = 1 };
typedef struct CvkMoeArgs {
  const void* x;
  void* out;
  const float* logits;
  const int64_t* experts;
  void* scratch;
  int64_t T, x_stride, hidden, inter, scratch_bytes;
  int32_t dtype, E, top_k, norm_topk_prob, num_threads;
} CvkMoeArgs;

/* Many LoRA adapters in one step (cvk_lora_apply, lora.cpp): for each segment s (rows[seg_start[s] ..
 * seg_start[s + 1]), all of adapter slot seg_slot[s]) y[row] += (x[row] A[slot]) B[slot], with A [slots][K][SR]
 * and B [slots][SR][N] of w_dtype (CVK_F32 or CVK_BF16; the adapter's scaling folded in), SR = num_subs x R: the
 * columns [sub_cols[p], sub_cols[p + 1]) of y (one part of a fused projection) read rank slice p of the shrink only.
 * x and y are dtype, rows x_stride / y_stride elements apart; scratch float32 [M][SR], M = seg_start[num_segs]. */
typedef struct CvkLoraArgs {
  const void* x;
  void* y;
  const void* a;
  const void* b;
  const int64_t* rows;
  const int64_t* seg_start;
  const int64_t* seg_slot;
  const int64_t* sub_cols;
  float* scratch;
  int64_t x_stride, y_stride, K, N, SR, R, num_segs, num_subs;
  int32_t dtype, num_threads, w_dtype;
} CvkLoraArgs;

/* Bidirectional (non-causal) attention over a step's packed sequences (cvk_encoder_attention,
 * encoder_attention.cpp): sequence s owns rows [cu_seqlens[s], cu_seqlens[s + 1]) (cu_seqlens [num_seqs + 1],
 * cu_seqlens[0] = 0), and each of its queries attends to every key of its own sequence: no mask, no cache.
 *   q [T, q_stride] holds H heads of D values per row, k [T, k_stride] and v [T, v_stride] KVH heads each (views of
 *   one fused qkv buffer are fine); out [T, out_stride] gets H * D per row (rows of no sequence are not touched).
 *   dtype CVK_F32 or CVK_BF16 (softmax and sums float32); D a multiple of 16 up to 256 and H a multiple of KVH, else
 *   CVK_ERR_UNSUPPORTED. */
typedef struct CvkEncoderAttnArgs {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const int64_t* cu_seqlens;
  int64_t q_stride, k_stride, v_stride, out_stride;
  int32_t dtype, num_seqs, H, KVH, D, num_threads;
  float scale;
} CvkEncoderAttnArgs;

enum { CVK_STRUCT_ATTN_ARGS = 0, CVK_STRUCT_LAYER_STACK_ARGS = 1, CVK_STRUCT_QUANT_WEIGHT = 2,
       CVK_STRUCT_QUANT_GEMM_ARGS = 3, CVK_STRUCT_MOE_ARGS = 4,
       CVK_STRUCT_LORA_ARGS = 5, CVK_STRUCT_ENCODER_ATTN_ARGS = 6 }; /* cvk_struct_layout's `which` */

#ifdef __cplusplus
static_assert(sizeof(CvkQuantWeight) == 5 * 8 + 3 * 8 + 2 * 4, "CvkQuantWeight changed: bump CVK_ABI_VERSION");
static_assert(sizeof(CvkQuantGemmArgs) == 5 * 8 + 4 * 8 + 2 * 4, "CvkQuantGemmArgs changed: bump CVK_ABI_VERSION");
static_assert(sizeof(CvkLoraArgs) == 9 * 8 + 8 * 8 + 4 * 4 /* 3 int32, padding */,
              "CvkLoraArgs changed: bump CVK_ABI_VERSION");
static_assert(sizeof(CvkEncoderAttnArgs) == 5 * 8 + 4 * 8 + 7 * 4 + 4 /* tail padding */,
              "CvkEncoderAttnArgs changed: bump CVK_ABI_VERSION");
static_assert(sizeof(CvkMoeArgs) == 5 * 8 + 5 * 8 + 5 * 4 + 4, "CvkMoeArgs changed: bump CVK_ABI_VERSION");
#endif

#endif /* CVK_H */
