// conveyor's CPU kernels: paged attention for a whole step (rope + KV write + attention), residual add +
// RMSNorm, SiLU-and-mul. Plain C ABI and no torch headers, so a build takes seconds; loaded with ctypes.
//
// The same source is compiled once per instruction-set level, with that level's flags and one of
//   CVK_AVX512BF16 (AVX-512 F/BW/VL/DQ + AVX512_BF16), CVK_AVX512 (AVX-512 F/BW/VL/DQ), CVK_AVX2 (AVX2 + FMA)
// defined; Python loads only a level this CPU reports (conveyor/kernels/cpu_features.py). Tensors are float32
// (dtype 0) or bfloat16 (dtype 1, stored as uint16); all arithmetic is float32.
// Threads: OpenMP, linked by soname against the libgomp torch has already loaded, so these are torch's own
// intra-op threads (a second pool would fight torch's spinning workers for the same cores).

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <vector>

namespace {

// Runs `body` on a team of `threads` OpenMP threads, or, when called from inside a parallel region (the
// decoder-layer stack opens one per step: cvk_llama_layers), on that region's team, every thread of which
// calls it. The kernels' loops are orphaned `omp for`s, so they share out over whichever team runs them, and
// each ends with the loop's barrier. One region per step instead of one per kernel call: a fork/join cost
// several times a barrier here, and a step of SmolLM2 made about 150 of them.
template <class Body>
inline void on_team(int threads, Body&& body) {
  if (omp_in_parallel()) {
    body();
  } else {
#pragma omp parallel num_threads(threads)
    body();
  }
}

// 64-byte aligned storage for std::vector (aligned vector loads and stores of per-thread scratch).
template <typename T>
struct AlignedAlloc {
  using value_type = T;
  AlignedAlloc() = default;
  template <typename U>
  AlignedAlloc(const AlignedAlloc<U>&) {}
  T* allocate(size_t n) {
    void* p = aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (!p) abort();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { free(p); }
  template <typename U>
  bool operator==(const AlignedAlloc<U>&) const { return true; }
  template <typename U>
  bool operator!=(const AlignedAlloc<U>&) const { return false; }
};

// exp(r) for |r| <= ln(2)/2: the Cephes polynomial, shared by every vector width (V::exp reduces x to r).
template <class Vec>
inline Vec exp_poly(Vec r) {
  Vec p = Vec::set1(1.9875691500E-4f);
  p = Vec::fma(p, r, Vec::set1(1.3981999507E-3f));
  p = Vec::fma(p, r, Vec::set1(8.3334519073E-3f));
  p = Vec::fma(p, r, Vec::set1(4.1665795894E-2f));
  p = Vec::fma(p, r, Vec::set1(1.6666665459E-1f));
  p = Vec::fma(p, r, Vec::set1(5.0000001201E-1f));
  return Vec::fma(p, r * r, r + Vec::set1(1.0f));
}

// ---------------------------------------------------------------------------------------------------------
// A float vector of the compiled width, with the few operations the kernels need.
#if defined(CVK_AVX512) || defined(CVK_AVX512BF16)
constexpr int W = 16;
struct V {
  __m512 v;
  static V zero() { return {_mm512_setzero_ps()}; }
  static V set1(float x) { return {_mm512_set1_ps(x)}; }
  static V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V load(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(uint16_t* p) const {
#if defined(CVK_AVX512BF16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
    // Round to nearest even, as torch does; NaN stays a quiet NaN.
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
  }
  friend V operator+(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend V operator-(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend V operator*(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend V operator/(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
  static V fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
  static V max(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
  static bool any_ne(V a, V b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_NEQ_UQ) != 0; }
  static int first_eq(V a, V b) {  // the first lane where a == b, or -1
    const unsigned m = _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ);
    return m ? __builtin_ctz(m) : -1;
  }
  static bool any_nan(V a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q) != 0; }
  static V rcp(V a) {  // 1 / a to ~23 bits: a 14-bit estimate and one Newton step (no slow division)
    __m512 r = _mm512_rcp14_ps(a.v);
    return {_mm512_mul_ps(r, _mm512_fnmadd_ps(a.v, r, _mm512_set1_ps(2.0f)))};
  }
  static V blend_gt(V a, V b, V if_gt, V otherwise) {  // a > b ? if_gt : otherwise, per lane
    return {_mm512_mask_mov_ps(otherwise.v, _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ), if_gt.v)};
  }
  // One vector whose lane j is the sum of the lanes of a[j], for W vectors (a transpose-add tree: ~45
  // instructions for 16 sums instead of 16 separate horizontal reductions).
  static V hsum_lanes(const V* a) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
      t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i].v, a[2 * i + 1].v), _mm512_unpackhi_ps(a[2 * i].v, a[2 * i + 1].v));
    for (int i = 0; i < 4; i++) {
      __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
      u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // u[i]: in each 128-bit lane, partial sums of vectors 4i..4i+3; now add the four 128-bit lanes.
    __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return {_mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xdd))};
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float hmax() const { return _mm512_reduce_max_ps(v); }
  // exp(x) for x <= 88; 0 for x < -87 (so exp(-inf) == 0 exactly: masked scores contribute nothing).
  static V exp(V x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x.v, lo, _CMP_LT_OQ);
    __m512 xc = _mm512_min_ps(_mm512_max_ps(x.v, lo), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    const __m512 p = exp_poly(V{r}).v;
    return {_mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n))};
  }
};
#elif defined(CVK_AVX2)
constexpr int W = 8;
struct V {
  __m256 v;
  static V zero() { return {_mm256_setzero_ps()}; }
  static V set1(float x) { return {_mm256_set1_ps(x)}; }
  static V load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static V load(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(uint16_t* p) const {
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  friend V operator+(V a, V b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend V operator-(V a, V b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend V operator*(V a, V b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend V operator/(V a, V b) { return {_mm256_div_ps(a.v, b.v)}; }
  static V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static V max(V a, V b) { return {_mm256_max_ps(a.v, b.v)}; }
  static bool any_ne(V a, V b) { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_NEQ_UQ)) != 0; }
  static int first_eq(V a, V b) {  // the first lane where a == b, or -1
    const unsigned m = unsigned(_mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ)));
    return m ? __builtin_ctz(m) : -1;
  }
  static bool any_nan(V a) { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)) != 0; }
  static V rcp(V a) {  // 1 / a to ~22 bits: a 12-bit estimate and one Newton step
    __m256 r = _mm256_rcp_ps(a.v);
    return {_mm256_mul_ps(r, _mm256_fnmadd_ps(a.v, r, _mm256_set1_ps(2.0f)))};
  }
  static V blend_gt(V a, V b, V if_gt, V otherwise) {
    return {_mm256_blendv_ps(otherwise.v, if_gt.v, _mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ))};
  }
  static V hsum_lanes(const V* a) {  // lane j = sum of the lanes of a[j], for 8 vectors
    __m256 t0 = _mm256_hadd_ps(a[0].v, a[1].v), t1 = _mm256_hadd_ps(a[2].v, a[3].v);
    __m256 t2 = _mm256_hadd_ps(a[4].v, a[5].v), t3 = _mm256_hadd_ps(a[6].v, a[7].v);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return {_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31))};
  }
  float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  float hmax() const {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static V exp(V x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 tiny = _mm256_cmp_ps(x.v, lo, _CMP_LT_OQ);
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x.v, lo), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    const __m256 p = exp_poly(V{r}).v;
    // 2^n: n + 127 in the exponent bits (n is in [-126, 127] after the clamps above).
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return {_mm256_andnot_ps(tiny, y)};
  }
};
#else
#error "compile with one of CVK_AVX512BF16, CVK_AVX512, CVK_AVX2"
#endif

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline void from_f32(float x, float* p) { *p = x; }
inline void from_f32(float x, uint16_t* p) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *p = 0x7fc0;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = uint16_t(u >> 16);
}

// ---------------------------------------------------------------------------------------------------------
// Attention. One work item = (request, kv head, tile of queries): its G query heads x up to TQ queries (the
// item's rows) share every K/V row they read. Keys are walked in chunks of KC with an online softmax
// (flash-attention style), so nothing grows with the context, and K/V rows are read straight from the paged
// cache through the block table. Two shapes of inner loop:
//  - one query (decodes): rows = the G heads; scores by dot products, 16 (8) keys at a time reduced with one
//    transpose-add tree; the loop streams K and V from memory once, which is what bounds it.
//  - a tile of queries (prefill chunks): rows = queries x heads, held transposed (rows in vector lanes), so
//    QK^T, the masked online softmax and PV are all full-width vector work, GEMM-like. In bfloat16 on a CPU
//    with AMX, QK^T and PV run on tiles instead (amx_chunk_scores, amx_chunk_pv): 1.7x the vector path.
constexpr int KC = 32;                    // keys per chunk
constexpr int RV_MAX = 2;                 // row vectors of a tile item
constexpr int MAX_ROWS = RV_MAX * W;      // rows of a tile item: 32 (AVX-512) / 16 (AVX2)
constexpr int KB = W == 16 ? 8 : 4;       // keys per register block of the tile QK^T
constexpr int MAX_D = 128;
constexpr int MAX_G = 16;                 // query heads per kv head
constexpr int MAX_QROWS = 64;             // rows (query heads) of a one-query item

alignas(64) const float kZeros[MAX_D] = {};  // a K/V "row" for padding a chunk to full blocks (masked out)

struct AttnArgs {
  void* q; int64_t q_stride;
  void* k; int64_t k_stride;
  const void* v; int64_t v_stride;
  const void* k_cache; const void* v_cache;
  const int64_t* block_table; int64_t bt_stride;
  const int64_t* query_start; const int64_t* seq_lens;
  void* out; int64_t out_stride;
  int H, KVH, D, bs;
  float scale;
};

struct Item {
  int req, kvh, kvh_end, q0, q1;  // kv heads [kvh, kvh_end), queries [q0, q1) of the request's new tokens
  int64_t cost;
};

// The cache layout is head-major inside a block, [num_blocks, KVH, bs, D] (as vLLM's CPU backend keeps it): one
// head's keys of a block are contiguous, so reading a request's context for a head streams whole pages in order.
// Element offset of the row of position `pos`, head h:
inline int64_t kv_offset(const AttnArgs& a, const int64_t* table, int64_t pos, int h) {
  return ((table[pos / a.bs] * a.KVH + h) * a.bs + pos % a.bs) * int64_t(a.D);
}

// Offsets (head 0) of the rows of positions [j0, j0 + n): one division, then block by block (a division per key
// cost as much as the rest of the decode loop).
inline void kv_offsets(const AttnArgs& a, const int64_t* table, int64_t j0, int n, int64_t* offs) {
  int64_t b = j0 / a.bs;
  int off = int(j0 - b * a.bs);
  const int64_t block_elems = int64_t(a.KVH) * a.bs * a.D;
  for (int j = 0; j < n; j++) {
    offs[j] = table[b] * block_elems + int64_t(off) * a.D;
    if (++off == a.bs) {
      off = 0;
      b++;
    }
  }
}

// Float32 rows of keys [j0, j0 + n) of kv head h, padded to `pad` rows with zeros: pointers straight into the
// cache (T = float) or into `buf` after conversion (T = bfloat16).
template <typename T, int DV>
inline void chunk_rows(const AttnArgs& a, const int64_t* table, const T* base, int h, int64_t j0, int n, int pad,
                       const float** rows, float* buf) {
  constexpr int D = DV * W;
  int64_t offs[KC];
  kv_offsets(a, table, j0, n, offs);
  const int64_t head = int64_t(h) * a.bs * D;
  for (int j = 0; j < n; j++) {
    const T* src = base + offs[j] + head;
    if constexpr (sizeof(T) == 4) {
      rows[j] = reinterpret_cast<const float*>(src);
    } else {
      for (int d = 0; d < DV; d++) V::load(src + d * W).store(buf + j * D + d * W);
      rows[j] = buf + j * D;
    }
  }
  for (int j = n; j < pad; j++) rows[j] = kZeros;
}

// The cache lines of the next chunk of a decode item's head (its K and V rows), asked for into L2 a few at a
// time from inside this chunk's loops: `step()` once per inner iteration, `per` lines each, so the requests
// spread over the chunk's compute. Asking for them in bursts (V into L1 before the scores, the next K into L2)
// stalled the core on full fill buffers (perf: a third of the kernel's samples on those prefetches) and left
// memory idle while it computed. Alternated A/B (30 SmolLM2 layers, caches from DRAM, best of 10), requests x
// keys: bfloat16 86 x 190 / 500 31.41 / 80.52 -> 26.12 / 70.84 ms, 16 x 500 14.18 -> 11.79; float32 86 x 190 / 500
// 42.09 / 108.25 -> 36.74 / 93.39. Into L1 (T0) did no better.
struct LineCursor {
  static constexpr int kMaxLines = 2 * KC * MAX_D * 4 / 64;  // K and V rows of a chunk, float32 at MAX_D
  const char* lines[kMaxLines];
  int n = 0, next = 0, per = 1;
  inline void add_row(const void* row, int bytes) {
    for (int b = 0; b < bytes; b += 64) lines[n++] = static_cast<const char*>(row) + b;
  }
  inline void step() {
    for (const int end = std::min(n, next + per); next < end; next++) _mm_prefetch(lines[next], _MM_HINT_T1);
  }
  inline void flush() {
    for (; next < n; next++) _mm_prefetch(lines[next], _MM_HINT_T1);
  }
};

// O[r] += sum_j P[j * p_stride + r * p_step] * v_j for R rows, accumulating in registers. pfc: a decode item's
// prefetch cursor, stepped once per key (null for tiles).
template <int DV, int R>
inline void pv_block(const float* P, int p_stride, int p_step, const float* const* vrow, int nk, float* O,
                     LineCursor* pfc) {
  constexpr int D = DV * W;
  V acc[R][DV];
  for (int i = 0; i < R; i++)
    for (int d = 0; d < DV; d++) acc[i][d] = V::load(O + i * D + d * W);
  for (int j = 0; j < nk; j++) {
    V p[R];
    for (int i = 0; i < R; i++) p[i] = V::set1(P[j * p_stride + i * p_step]);
    if (pfc) pfc->step();
    for (int d = 0; d < DV; d++) {
      const V v = V::load(vrow[j] + d * W);
      for (int i = 0; i < R; i++) acc[i][d] = V::fma(p[i], v, acc[i][d]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int d = 0; d < DV; d++) acc[i][d].store(O + i * D + d * W);
}

// All rows: O[r] += sum_j P(j, r) v_j, in register blocks of up to RB rows: each V row is loaded once per block,
// so a group of G heads (G <= RB) reads it once.
template <int DV>
inline void pv_all(const float* P, int p_stride, int p_step, int nrows, const float* const* vrow, int nk, float* O,
                   LineCursor* pfc = nullptr) {
  constexpr int D = DV * W;
  constexpr int RB = DV <= 4 ? 4 : (DV <= 8 ? 2 : 1);
  for (int r = 0; r < nrows; r += RB) {
    const float* p = P + r * p_step;
    float* o = O + r * D;
    switch (std::min(RB, nrows - r)) {
      case 4: pv_block<DV, (RB >= 4 ? 4 : 1)>(p, p_stride, p_step, vrow, nk, o, pfc); break;
      case 3: pv_block<DV, (RB >= 3 ? 3 : 1)>(p, p_stride, p_step, vrow, nk, o, pfc); break;
      case 2: pv_block<DV, (RB >= 2 ? 2 : 1)>(p, p_stride, p_step, vrow, nk, o, pfc); break;
      default: pv_block<DV, 1>(p, p_stride, p_step, vrow, nk, o, pfc); break;
    }
  }
}

// Write rows' outputs O[r] / l[r] to their (query, head) place.
// A tile's rows are (query q0 + r / G, head kvh * G + r % G); a one-query item's rows are heads kvh * G + r.
template <typename T, int DV>
inline void store_rows(const AttnArgs& a, const Item& it, int64_t qs, int nrows, const float* O, const float* l) {
  constexpr int D = DV * W;
  const int G = a.H / a.KVH;
  const bool one_query = it.q1 - it.q0 == 1;
  for (int r = 0; r < nrows; r++) {
    const int i = one_query ? it.q0 : it.q0 + r / G, h = one_query ? it.kvh * G + r : it.kvh * G + r % G;
    T* dst = static_cast<T*>(a.out) + (qs + i) * a.out_stride + int64_t(h) * D;
    const V inv = V::set1(1.f / l[r]);
    for (int d = 0; d < DV; d++) (V::load(O + r * D + d * W) * inv).store(dst + d * W);
  }
}

#if defined(CVK_AVX512BF16)
// bfloat16 dot products in hardware (VDPBF16PS: 32 products per instruction, no conversions): scores of the
// G rows of one kv head over a chunk of keys; q rows and K rows are bfloat16 as stored.
template <int DV>
inline void scores_bf16(const uint16_t* q, int64_t q_head_stride, int G, const uint16_t* const* krow, int kp,
                        float scale, float* S, int s_stride, LineCursor& pfc) {
  constexpr int D2 = DV / 2;  // 32 bfloat16 per vector
  for (int r = 0; r < G; r++) {
    __m512bh qr[D2 > 0 ? D2 : 1];
    for (int d = 0; d < D2; d++) qr[d] = (__m512bh)_mm512_loadu_si512(q + r * q_head_stride + d * 32);
    for (int jg = 0; jg < kp; jg += W) {
      V acc[W];
      for (int u = 0; u < W; u++) {
        __m512 x = _mm512_setzero_ps();
        for (int d = 0; d < D2; d++) x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_loadu_si512(krow[jg + u] + d * 32), qr[d]);
        if (r == 0) pfc.step();  // once per key, not per (row, key): see attend_one_query's steps
        acc[u] = {x};
      }
      (V::hsum_lanes(acc) * V::set1(scale)).store(S + r * s_stride + jg);
    }
  }
}

// O[r] += P[r] V over a chunk of keys taken in pairs (VDPBF16PS on (p_j, p_j+1) x (v_j[d], v_j+1[d])).
// O rows stay in the pair-interleaved order these products produce: see unpermute_row.
template <int DV, int R>
inline void pv_bf16_block(const uint16_t* Pb, int pb_stride, const uint16_t* const* vrow, int kp, float* O,
                          LineCursor& pfc) {
  constexpr int D = DV * W, D2 = DV / 2;
  __m512 acc[R][DV];
  for (int i = 0; i < R; i++)
    for (int d = 0; d < DV; d++) acc[i][d] = _mm512_loadu_ps(O + i * D + d * W);
  for (int j = 0; j < kp; j += 2) {
    __m512i lo[D2], hi[D2];
    for (int d = 0; d < D2; d++) {
      const __m512i v0 = _mm512_loadu_si512(vrow[j] + d * 32), v1 = _mm512_loadu_si512(vrow[j + 1] + d * 32);
      lo[d] = _mm512_unpacklo_epi16(v0, v1);
      hi[d] = _mm512_unpackhi_epi16(v0, v1);
    }
    pfc.step();
    for (int i = 0; i < R; i++) {
      uint32_t pair;
      memcpy(&pair, Pb + i * pb_stride + j, 4);
      const __m512bh p = (__m512bh)_mm512_set1_epi32(int(pair));
      for (int d = 0; d < D2; d++) {
        acc[i][2 * d] = _mm512_dpbf16_ps(acc[i][2 * d], (__m512bh)lo[d], p);
        acc[i][2 * d + 1] = _mm512_dpbf16_ps(acc[i][2 * d + 1], (__m512bh)hi[d], p);
      }
    }
  }
  for (int i = 0; i < R; i++)
    for (int d = 0; d < DV; d++) _mm512_storeu_ps(O + i * D + d * W, acc[i][d]);
}

// Undo the pair interleave of pv_bf16_block: per 32 values, lo holds d = 8k + {0..3}, hi d = 8k + 4 + {0..3}.
inline void unpermute_row(float* o, int D) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int d = 0; d < D; d += 32) {
    const __m512 lo = _mm512_loadu_ps(o + d), hi = _mm512_loadu_ps(o + d + 16);
    _mm512_storeu_ps(o + d, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(o + d + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}
#endif

// One query over kv heads [kvh, kvh_end): rows r = query heads kvh * G .. kvh_end * G. Per chunk of keys, every
// head of the item reads its slice of the same K/V rows, so a chunk streams from memory once, in order.
template <typename T, int DV>
void attend_one_query(const AttnArgs& a, const Item& it) {
  constexpr int D = DV * W;
  constexpr int KP = (KC + W - 1) / W * W;  // chunk padded to whole score vectors
  constexpr bool kDpbf16 =
#if defined(CVK_AVX512BF16)
      sizeof(T) == 2;
#else
      false;
#endif
  const int G = a.H / a.KVH;
  const int rows = (it.kvh_end - it.kvh) * G;
  const int64_t qs = a.query_start[it.req];
  const int64_t ctx0 = a.seq_lens[it.req] - (a.query_start[it.req + 1] - qs);
  const int64_t end = ctx0 + it.q0 + 1;  // keys [0, end)
  const int64_t* table = a.block_table + int64_t(it.req) * a.bt_stride;
  const int64_t hstride = int64_t(a.bs) * D;  // from one head's rows of a block to the next head's
  const T* qrow = static_cast<const T*>(a.q) + (qs + it.q0) * a.q_stride + int64_t(it.kvh) * G * D;

  alignas(64) float q[kDpbf16 ? 1 : MAX_QROWS * D];
  alignas(64) float O[MAX_QROWS * D];
  alignas(64) float S[MAX_QROWS * KP];
  alignas(64) uint16_t Pb[kDpbf16 ? MAX_QROWS * KP : 1];
  alignas(64) float kbuf[sizeof(T) == 2 && !kDpbf16 ? KC * D : 1];
  alignas(64) float vbuf[sizeof(T) == 2 && !kDpbf16 ? KC * D : 1];
  float m[MAX_QROWS], l[MAX_QROWS];
  const T* kbase[KP];
  const T* vbase[KP];
  const float* krow[KP];
  const float* vrow[KP];

  if (!kDpbf16) {
    const V scale = V::set1(a.scale);
    for (int r = 0; r < rows; r++)
      for (int d = 0; d < DV; d++) (V::load(qrow + r * D + d * W) * scale).store(q + r * D + d * W);
  }
  for (int r = 0; r < rows; r++) {
    for (int d = 0; d < DV; d++) V::zero().store(O + r * D + d * W);
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  int64_t offs[KC], next_offs[KC];
  for (int64_t j0 = 0; j0 < end; j0 += KC) {
    const int nk = int(std::min<int64_t>(KC, end - j0));
    const int nk_next = int(std::max<int64_t>(0, std::min<int64_t>(KC, end - j0 - KC)));
    kv_offsets(a, table, j0, nk, offs);
    kv_offsets(a, table, j0 + KC, nk_next, next_offs);
    for (int j = 0; j < KP; j++) {
      if (j < nk) {
        kbase[j] = static_cast<const T*>(a.k_cache) + offs[j];
        vbase[j] = static_cast<const T*>(a.v_cache) + offs[j];
      } else {
        kbase[j] = vbase[j] = reinterpret_cast<const T*>(kZeros);  // zero rows; their scores are masked
      }
    }
    for (int h = it.kvh; h < it.kvh_end; h++) {
      const int r0 = (h - it.kvh) * G;
      float* s0 = S + r0 * KP;
      // this head's K and V rows of the next chunk, asked for over this chunk's work (LineCursor)
      LineCursor pfc;
      for (int j = 0; j < nk_next; j++) {
        pfc.add_row(static_cast<const T*>(a.k_cache) + next_offs[j] + h * hstride, int(D * sizeof(T)));
        pfc.add_row(static_cast<const T*>(a.v_cache) + next_offs[j] + h * hstride, int(D * sizeof(T)));
      }
      {
        // cursor steps: the scores' keys x rows (float32) or keys (bfloat16: stepping once per (row, key) cost
        // more than it hid; 30 SmolLM2 layers, 86 requests x 300 keys from DRAM, alternated: 40.3-40.8 ->
        // 37.9-38.8 ms; the same change in float32 was 5-7% slower), then PV's keys (or key pairs)
        const int steps = kDpbf16 ? KP + KP / 2 : G * KP + KP;
        pfc.per = std::max(1, (pfc.n + steps - 1) / steps);
      }
      if constexpr (kDpbf16) {
#if defined(CVK_AVX512BF16)
        const uint16_t* kh[KP];
        for (int j = 0; j < KP; j++) kh[j] = reinterpret_cast<const uint16_t*>(kbase[j]) + (j < nk ? h * hstride : 0);
        scores_bf16<DV>(reinterpret_cast<const uint16_t*>(qrow) + r0 * D, D, G, kh, KP, a.scale, s0, KP, pfc);
#endif
      } else {
        for (int j = 0; j < KP; j++) {
          if (j >= nk) krow[j] = kZeros;
          else if constexpr (sizeof(T) == 4) krow[j] = reinterpret_cast<const float*>(kbase[j] + h * hstride);
          else {
            for (int d = 0; d < DV; d++) V::load(kbase[j] + h * hstride + d * W).store(kbuf + j * D + d * W);
            krow[j] = kbuf + j * D;
          }
        }
        for (int r = r0; r < r0 + G; r++) {
          V qr[DV];
          for (int d = 0; d < DV; d++) qr[d] = V::load(q + r * D + d * W);
          for (int jg = 0; jg < KP; jg += W) {
            V acc[W];
            for (int u = 0; u < W; u++) {
              acc[u] = V::zero();
              for (int d = 0; d < DV; d++) acc[u] = V::fma(qr[d], V::load(krow[jg + u] + d * W), acc[u]);
              pfc.step();
            }
            V::hsum_lanes(acc).store(S + r * KP + jg);
          }
        }
      }
      // online softmax, row by row
      for (int r = r0; r < r0 + G; r++) {
        float* s = S + r * KP;
        for (int j = nk; j < KP; j++) s[j] = -INFINITY;
        V mx = V::set1(m[r]);
        for (int j = 0; j < KP; j += W) mx = V::max(mx, V::load(s + j));
        const float m_new = mx.hmax();  // finite: key 0 is in the first chunk
        const float alpha = expf(m[r] - m_new);
        const V mn = V::set1(m_new);
        V psum = V::zero();
        for (int j = 0; j < KP; j += W) {
          const V p = V::exp(V::load(s + j) - mn);
          p.store(s + j);
          psum = psum + p;
        }
        l[r] = l[r] * alpha + psum.sum();
        m[r] = m_new;
        if (alpha != 1.f) {
          const V al = V::set1(alpha);
          for (int d = 0; d < DV; d++) (V::load(O + r * D + d * W) * al).store(O + r * D + d * W);
        }
      }
      if constexpr (kDpbf16) {
#if defined(CVK_AVX512BF16)
        for (int r = r0; r < r0 + G; r++)
          for (int j = 0; j < KP; j += 32)
            _mm512_storeu_si512(Pb + r * KP + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(S + r * KP + j + 16),
                                                                             _mm512_loadu_ps(S + r * KP + j)));
        const uint16_t* vh[KP];
        for (int j = 0; j < KP; j++) vh[j] = reinterpret_cast<const uint16_t*>(vbase[j]) + (j < nk ? h * hstride : 0);
        const int kp2 = (nk + 1) & ~1;
        constexpr int RB = DV <= 4 ? 4 : 2;
        for (int r = r0; r < r0 + G; r += RB) {
          const uint16_t* pb = Pb + r * KP;
          float* o = O + r * D;
          switch (std::min(RB, r0 + G - r)) {
            case 4: pv_bf16_block<DV, (RB >= 4 ? 4 : 1)>(pb, KP, vh, kp2, o, pfc); break;
            case 3: pv_bf16_block<DV, (RB >= 3 ? 3 : 1)>(pb, KP, vh, kp2, o, pfc); break;
            case 2: pv_bf16_block<DV, 2>(pb, KP, vh, kp2, o, pfc); break;
            default: pv_bf16_block<DV, 1>(pb, KP, vh, kp2, o, pfc); break;
          }
        }
        pfc.flush();
#endif
      } else {
        for (int j = 0; j < nk; j++) {
          if constexpr (sizeof(T) == 4) vrow[j] = reinterpret_cast<const float*>(vbase[j] + h * hstride);
          else {
            for (int d = 0; d < DV; d++) V::load(vbase[j] + h * hstride + d * W).store(vbuf + j * D + d * W);
            vrow[j] = vbuf + j * D;
          }
        }
        pv_all<DV>(s0, 1, KP, G, vrow, nk, O + r0 * D, &pfc);
        pfc.flush();
      }
    }
  }
#if defined(CVK_AVX512BF16)
  if constexpr (kDpbf16)
    for (int r = 0; r < rows; r++) unpermute_row(O + r * D, D);
#endif
  store_rows<T, DV>(a, it, qs, rows, O, l);
}

#if defined(CVK_AVX512BF16)
// Prefill attention's QK^T on AMX tiles (bfloat16): set by cvk_amx_init once Linux grants the tile state, and
// switchable (cvk_set_amx_attention) so tests and benchmarks can run both paths.
bool g_amx_attention = false;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

__attribute__((target("amx-tile,amx-bf16"))) inline void amx_configure(int rows0, int rows1) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  const int r1 = rows1 > 0 ? rows1 : 1;
  const int rows[8] = {rows0, r1, 16, 16, rows0, rows0, r1, r1};
  for (int t = 0; t < 8; t++) {
    cfg.rows[t] = uint8_t(rows[t]);
    cfg.colsb[t] = 64;
  }
  // GCC does not count LDTILECFG as reading the whole 64 bytes: without this barrier it dropped the rows and
  // colsb stores of an out-of-line copy of this function (palette 1, no tile configured: SIGILL at first use).
  __asm__ __volatile__("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}
constexpr int TILE_KEYS = 16;  // keys per AMX tile: one group must sit inside one cache block (bs % 16 == 0)

// S^T[key][row] = K[key] . Q[row] for one chunk of KC = 32 keys (two groups of 16) and up to 32 rows (two
// groups of 16): TDPBF16PS with K rows as the A operand, loaded straight from the cache (a head's rows of a
// block are contiguous, D * 2 bytes apart), and q in VNNI pairs (qt2 [D / 2][MAX_ROWS]) as B, so the result comes
// out in ST's own [key][row] layout and the softmax below is unchanged. k0, k1: the first row of key group 0 and 1,
// or null when the group has no visible key (its ST rows are not written: they are masked). Unscaled.
// Tiles: 0, 1 = K groups; 2, 3 = q row groups; 4 + 2 g + rg = the S^T block of (key group g, row group rg).
__attribute__((target("amx-tile,amx-bf16")))
void amx_chunk_scores(const uint32_t* qt2, const uint16_t* k0, const uint16_t* k1, int D, bool two_row_groups,
                      float* ST) {
  const int64_t kstride = int64_t(D) * 2, qstride = MAX_ROWS * 4, sstride = MAX_ROWS * 4;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int db = 0; db < D / 32; db++) {
    const uint32_t* q = qt2 + int64_t(db) * 16 * MAX_ROWS;
    _tile_loadd(2, q, qstride);
    if (two_row_groups) _tile_loadd(3, q + 16, qstride);
    if (k0 != nullptr) {
      _tile_loadd(0, k0 + db * 32, kstride);
      _tile_dpbf16ps(4, 0, 2);
      if (two_row_groups) _tile_dpbf16ps(5, 0, 3);
    }
    if (k1 != nullptr) {
      _tile_loadd(1, k1 + db * 32, kstride);
      _tile_dpbf16ps(6, 1, 2);
      if (two_row_groups) _tile_dpbf16ps(7, 1, 3);
    }
  }
  if (k0 != nullptr) {
    _tile_stored(4, ST, sstride);
    if (two_row_groups) _tile_stored(5, ST + 16, sstride);
  }
  if (k1 != nullptr) {
    _tile_stored(6, ST + TILE_KEYS * MAX_ROWS, sstride);
    if (two_row_groups) _tile_stored(7, ST + TILE_KEYS * MAX_ROWS + 16, sstride);
  }
}

__attribute__((target("amx-tile,amx-bf16"))) inline void amx_release() { _tile_release(); }

// Transpose 16 x 16 32-bit values in registers: on entry r[i] = row i; on return r[k] = column kTransposedCol[k]
// (the last step leaves columns in this order; callers index by it instead of paying for a final permute).
constexpr int kTransposedCol[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
inline void transpose16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int u = 0; u < 2; u++) {
      r[i + u] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + u]), _mm512_castps_pd(t[i + 2 + u])));
      r[i + 2 + u] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + u]), _mm512_castps_pd(t[i + 2 + u])));
    }
  // r[4q + c] now holds, in 128-bit lane L, elements 4q .. 4q + 3 of row 4L + (0, 2, 1, 3)[c]
  for (int i = 0; i < 16; i += 8)
    for (int u = 0; u < 4; u++) {
      t[i + u] = _mm512_shuffle_f32x4(r[i + u], r[i + 4 + u], 0x88);
      t[i + 4 + u] = _mm512_shuffle_f32x4(r[i + u], r[i + 4 + u], 0xdd);
    }
  for (int u = 0; u < 8; u++) {
    r[u] = _mm512_shuffle_f32x4(t[u], t[u + 8], 0x88);
    r[u + 8] = _mm512_shuffle_f32x4(t[u], t[u + 8], 0xdd);
  }
}

// P^T for the AMX PV: pt[row][key] (bfloat16, 32 keys per row) from st[key][row] (float32, rows in lanes), keys
// >= nk as 0. Sixteen rows x sixteen keys at a time: a 16 x 16 transpose in registers, then one conversion per row.
inline void transpose_probs(const float* st, int nk, int row_groups, uint16_t* pt) {
  for (int rg = 0; rg < row_groups; rg++)
    for (int kb = 0; kb < 2; kb++) {
      __m512 r[16];
      for (int i = 0; i < 16; i++) {
        const int j = kb * 16 + i;
        r[i] = j < nk ? _mm512_loadu_ps(st + j * MAX_ROWS + rg * 16) : _mm512_setzero_ps();
      }
      transpose16x16(r);
      for (int k = 0; k < 16; k++)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pt + (rg * 16 + kTransposedCol[k]) * KC + kb * 16),
                            (__m256i)_mm512_cvtneps_pbh(r[k]));
    }
}

// q of a tile item in AMX's VNNI pair layout: qt2[d pair][row] = (q[row][2 p], q[row][2 p + 1]) for MAX_ROWS rows,
// rows >= nrows as zeros. Sixteen rows x sixteen pairs at a time, transposed in registers (a scalar fill of the
// 1024 pairs took 7% of the prefill attention samples).
template <int D>
inline void vnni_queries(const uint16_t* const* qrow, int nrows, uint32_t* qt2) {
  for (int rg = 0; rg < MAX_ROWS / 16; rg++)
    for (int pb = 0; pb < D / 32; pb++) {
      __m512 r[16];
      for (int i = 0; i < 16; i++) {
        const int row = rg * 16 + i;
        r[i] = row < nrows ? _mm512_castsi512_ps(_mm512_loadu_si512(qrow[row] + pb * 32)) : _mm512_setzero_ps();
      }
      transpose16x16(r);
      for (int k = 0; k < 16; k++) _mm512_storeu_ps(qt2 + (pb * 16 + kTransposedCol[k]) * MAX_ROWS + rg * 16, r[k]);
    }
}

// V of a chunk in AMX's VNNI layout: vv[d block][key pair][16 d x 2 keys] = (v[2p][d], v[2p + 1][d]), rows
// >= nk as zeros (a never-written slot may hold NaN, and 0 * NaN is NaN).
template <int D>
inline void vnni_values(const uint16_t* const* vrow, int nk, uint16_t* vv) {
  alignas(64) static const uint16_t kInterleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kInterleave);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int p = 0; p < KC / 2; p++) {
    const uint16_t* a = 2 * p < nk ? vrow[2 * p] : nullptr;
    const uint16_t* b = 2 * p + 1 < nk ? vrow[2 * p + 1] : nullptr;
    for (int h = 0; h < D / 32; h++) {
      const __m512i za = a ? _mm512_loadu_si512(a + h * 32) : _mm512_setzero_si512();
      const __m512i zb = b ? _mm512_loadu_si512(b + h * 32) : _mm512_setzero_si512();
      _mm512_storeu_si512(vv + ((2 * h) * (KC / 2) + p) * 32, _mm512_permutex2var_epi16(za, lo, zb));
      _mm512_storeu_si512(vv + ((2 * h + 1) * (KC / 2) + p) * 32, _mm512_permutex2var_epi16(za, hi, zb));
    }
  }
}

// O[rows][D] (float32, in memory) += P V for one chunk of 32 keys on AMX: pt [32 rows][32 keys] as A, vv as B.
// Tiles: 0, 2 = P row groups; 1 = a V block; 4, 5 = the O blocks, loaded, accumulated, stored.
__attribute__((target("amx-tile,amx-bf16")))
void amx_chunk_pv(const uint16_t* pt, const uint16_t* vv, int D, bool two_row_groups, float* O) {
  const int64_t ostride = int64_t(D) * 4;
  _tile_loadd(0, pt, KC * 2);
  if (two_row_groups) _tile_loadd(2, pt + 16 * KC, KC * 2);
  for (int dc = 0; dc < D / 16; dc++) {
    _tile_loadd(1, vv + dc * (KC / 2) * 32, 64);
    _tile_loadd(4, O + dc * 16, ostride);
    _tile_dpbf16ps(4, 0, 1);
    _tile_stored(4, O + dc * 16, ostride);
    if (two_row_groups) {
      _tile_loadd(5, O + 16 * D + dc * 16, ostride);
      _tile_dpbf16ps(5, 2, 1);
      _tile_stored(5, O + 16 * D + dc * 16, ostride);
    }
  }
}
#endif

// The online softmax of one chunk of a tile item, rows in vector lanes: ST[key][row] holds the chunk's scores
// (times `scale`: the AMX path's come unscaled, so m stays in their units and the scale goes into the exponent,
// one FMA; scale > 0, so the maximum is the same either way) and gets the probabilities; m, l: the rows' running
// maxima and sums; alpha: each row's rescale factor for O. Returns whether any row's maximum moved (else every
// alpha is exp(0) = 1 exactly and O needs no rescale). Not inlined: inside attend_tile its constants took
// registers from the QK^T loop, which then spilled its accumulators (float32 prefill 45% slower, measured).
__attribute__((noinline)) bool chunk_softmax(float* ST, int nkp, int rv_n, float scale, V* m, V* l, float* alpha) {
  // four running maxima and sums, nkp being a multiple of KB >= 4: one chain would wait on each op's latency
  static_assert(KB % 4 == 0, "the softmax below takes keys four at a time");
  const V sc = V::set1(scale);
  bool moved = false;
  for (int rv = 0; rv < rv_n; rv++) {
    V mx4[4] = {m[rv], m[rv], m[rv], m[rv]};
    for (int j = 0; j < nkp; j += 4)
      for (int u = 0; u < 4; u++) mx4[u] = V::max(mx4[u], V::load(ST + (j + u) * MAX_ROWS + rv * W));
    const V mx = V::max(V::max(mx4[0], mx4[1]), V::max(mx4[2], mx4[3]));
    const V al = V::exp((m[rv] - mx) * sc);  // 0 on the first chunk (m = -inf, mx finite)
    const V neg_mx = V::zero() - mx * sc;
    V ps4[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
    for (int j = 0; j < nkp; j += 4)
      for (int u = 0; u < 4; u++) {
        float* s = ST + (j + u) * MAX_ROWS + rv * W;
        const V p = V::exp(V::fma(V::load(s), sc, neg_mx));
        p.store(s);
        ps4[u] = ps4[u] + p;
      }
    const V psum = (ps4[0] + ps4[1]) + (ps4[2] + ps4[3]);
    l[rv] = V::fma(l[rv], al, psum);
    moved = moved || V::any_ne(m[rv], mx);
    m[rv] = mx;
    al.store(alpha + rv * W);
  }
  return moved;
}

// A tile of queries: rows r = (query q0 + r / G, head kvh * G + r % G) in vector lanes.
template <typename T, int DV>
void attend_tile(const AttnArgs& a, const Item& it) {
  constexpr int D = DV * W;
  constexpr int KP = (KC + KB - 1) / KB * KB;
  const int G = a.H / a.KVH;
  const int64_t qs = a.query_start[it.req];
  const int64_t ctx0 = a.seq_lens[it.req] - (a.query_start[it.req + 1] - qs);
  const int nrows = (it.q1 - it.q0) * G, rv_n = (nrows + W - 1) / W;
  const int64_t end = ctx0 + it.q1;        // keys [0, end) are visible to some row
  const int64_t diag = ctx0 + it.q0;       // keys <= diag are visible to every row
  const int64_t* table = a.block_table + int64_t(it.req) * a.bt_stride;
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
#if defined(CVK_AVX512BF16)
  const bool amx = sizeof(T) == 2 && g_amx_attention && a.bs % TILE_KEYS == 0 && D % 32 == 0;
#else
  constexpr bool amx = false;
#endif

  alignas(64) float QT[D * MAX_ROWS];   // [d][row], scaled (the vector path)
  alignas(64) uint32_t QT2[sizeof(T) == 2 ? D / 2 * MAX_ROWS : 1];  // [d pair][row], unscaled (the AMX path)
  alignas(64) uint16_t PT[sizeof(T) == 2 ? MAX_ROWS * KC : 1];         // AMX PV: P^T [row][key], bfloat16
  alignas(64) uint16_t VV[sizeof(T) == 2 ? D * KC : 1];                // AMX PV: V in VNNI pairs
  alignas(64) float O[MAX_ROWS * D];
  alignas(64) float ST[KP * MAX_ROWS];  // scores, then probabilities: [key][row]
  alignas(64) float last[MAX_ROWS];     // row r sees keys 0 .. last[r]
  alignas(64) float kbuf[sizeof(T) == 2 ? KC * D : 1];
  alignas(64) float vbuf[sizeof(T) == 2 ? KC * D : 1];
  alignas(64) float mrow[MAX_ROWS], lrow[MAX_ROWS], alpha[MAX_ROWS];
  const float* krow[KP];
  const float* vrow[KP];

  // The item's q rows are scattered over the step's qkv buffer (a row per token, heads inside it): request them
  // all before reading any, so their cache misses overlap (measured: the fill below took a fifth of the prefill
  // attention time without this).
  for (int r = 0; r < nrows; r++) {
    const char* src = reinterpret_cast<const char*>(static_cast<const T*>(a.q) + (qs + it.q0 + r / G) * a.q_stride +
                                                    int64_t(it.kvh * G + r % G) * D);
    for (int b = 0; b < int(D * sizeof(T)); b += 64) _mm_prefetch(src + b, _MM_HINT_T0);
  }
  const T* qsrc[MAX_ROWS];
  for (int r = 0; r < MAX_ROWS; r++) {
    const bool real = r < nrows;
    const int i = it.q0 + r / G, h = it.kvh * G + r % G;
    qsrc[r] = static_cast<const T*>(a.q) + (qs + i) * a.q_stride + int64_t(h) * D;
    if (!amx)
      for (int d = 0; d < D; d++) QT[d * MAX_ROWS + r] = real ? to_f32(qsrc[r][d]) * a.scale : 0.f;
    last[r] = float(real ? ctx0 + i : ctx0);  // padding rows see key 0 only: finite, ignored
  }
#if defined(CVK_AVX512BF16)
  if constexpr (sizeof(T) == 2 && D % 32 == 0)
    if (amx) vnni_queries<D>(reinterpret_cast<const uint16_t* const*>(qsrc), nrows, QT2);
#endif
  for (int r = 0; r < (amx ? MAX_ROWS : nrows) * D; r += W) V::zero().store(O + r);  // AMX: whole tiles
  V m[RV_MAX], l[RV_MAX];
  for (int rv = 0; rv < RV_MAX; rv++) {
    m[rv] = V::set1(-INFINITY);
    l[rv] = V::zero();
  }
  const V neg_inf = V::set1(-INFINITY);
#if defined(CVK_AVX512BF16)
  if (amx) amx_configure(16, 16);
#endif
  for (int64_t j0 = 0; j0 < end; j0 += KC) {
    const int nk = int(std::min<int64_t>(KC, end - j0));
    const int nkp = (nk + KB - 1) / KB * KB;
    if (!amx) chunk_rows<T, DV>(a, table, vc, it.kvh, j0, nk, 0, vrow, vbuf);
#if defined(CVK_AVX512BF16)
    if (amx) {
      const uint16_t* kgrp[2] = {nullptr, nullptr};
      for (int g = 0; g < 2; g++) {
        const int64_t pos = j0 + g * TILE_KEYS;
        if (pos < j0 + nk)
          kgrp[g] = reinterpret_cast<const uint16_t*>(kc) + kv_offset(a, table, pos, it.kvh);
      }
      amx_chunk_scores(QT2, kgrp[0], kgrp[1], D, rv_n > 1, ST);  // unscaled: the softmax applies the scale
    }
#endif
    if (!amx) chunk_rows<T, DV>(a, table, kc, it.kvh, j0, nk, nkp, krow, kbuf);
    // ST[j][rows] = sum_d K[j][d] * QT[d][rows]
    for (int jb = 0; !amx && jb < nkp; jb += KB) {
      V acc[KB][RV_MAX];
      for (int u = 0; u < KB; u++)
        for (int rv = 0; rv < RV_MAX; rv++) acc[u][rv] = V::zero();
      if (rv_n == 1) {
        for (int d = 0; d < D; d++) {
          const V qv = V::load(QT + d * MAX_ROWS);
          for (int u = 0; u < KB; u++) acc[u][0] = V::fma(V::set1(krow[jb + u][d]), qv, acc[u][0]);
        }
      } else {
        for (int d = 0; d < D; d++) {
          V qv[RV_MAX];
          for (int rv = 0; rv < RV_MAX; rv++) qv[rv] = V::load(QT + d * MAX_ROWS + rv * W);
          for (int u = 0; u < KB; u++) {
            const V kb = V::set1(krow[jb + u][d]);
            for (int rv = 0; rv < RV_MAX; rv++) acc[u][rv] = V::fma(kb, qv[rv], acc[u][rv]);
          }
        }
      }
      for (int u = 0; u < KB; u++)
        for (int rv = 0; rv < rv_n; rv++) acc[u][rv].store(ST + (jb + u) * MAX_ROWS + rv * W);
    }
    // causal mask where the chunk reaches past the diagonal, and the padding keys
    if (j0 + nk - 1 > diag || nk < nkp) {
      for (int j = 0; j < nkp; j++) {
        const V pos = V::set1(j < nk ? float(j0 + j) : INFINITY);
        for (int rv = 0; rv < rv_n; rv++) {
          float* s = ST + j * MAX_ROWS + rv * W;
          V::blend_gt(pos, V::load(last + rv * W), neg_inf, V::load(s)).store(s);
        }
      }
    }
    // online softmax (the AMX scores come unscaled; the vector path's q is pre-scaled)
    const bool rescale = chunk_softmax(ST, nkp, rv_n, amx ? a.scale : 1.f, m, l, alpha);
    if (j0 > 0 && rescale)
      for (int r = 0; r < nrows; r++) {
        const V al = V::set1(alpha[r]);
        for (int d = 0; d < DV; d++) (V::load(O + r * D + d * W) * al).store(O + r * D + d * W);
      }
#if defined(CVK_AVX512BF16)
    if (amx) {
      const uint16_t* vraw[KC];
      int64_t offs[KC];
      kv_offsets(a, table, j0, nk, offs);
      const int64_t head = int64_t(it.kvh) * a.bs * D;
      for (int j = 0; j < nk; j++) vraw[j] = reinterpret_cast<const uint16_t*>(vc) + offs[j] + head;
      vnni_values<D>(vraw, nk, VV);
      transpose_probs(ST, nk, rv_n, PT);
      amx_chunk_pv(PT, VV, D, rv_n > 1, O);
      continue;
    }
#endif
    pv_all<DV>(ST, MAX_ROWS, 1, nrows, vrow, nk, O);
  }
  for (int rv = 0; rv < rv_n; rv++) l[rv].store(lrow + rv * W);
  (void)mrow;
  store_rows<T, DV>(a, it, qs, nrows, O, lrow);
#if defined(CVK_AVX512BF16)
  if (amx) amx_release();
#endif
}

template <typename T, int DV>
inline void attend_item(const AttnArgs& a, const Item& it) {
  if (it.q1 - it.q0 == 1) attend_one_query<T, DV>(a, it);
  else attend_tile<T, DV>(a, it);
}

// Rotate (rotate-half layout) one head of D values in place by the angles of one position.
template <typename T>
inline void rope_head(T* x, const float* cs, int D) {
  const int half = D / 2;
  int d = 0;
  for (; d + W <= half; d += W) {
    V x1 = V::load(x + d), x2 = V::load(x + half + d);
    V c = V::load(cs + d), s = V::load(cs + half + d);
    (x1 * c - x2 * s).store(x + d);
    V::fma(x1, s, x2 * c).store(x + half + d);
  }
  for (; d < half; d++) {
    const float x1 = to_f32(x[d]), x2 = to_f32(x[half + d]), c = cs[d], s = cs[half + d];
    from_f32(x1 * c - x2 * s, x + d);
    from_f32(x2 * c + x1 * s, x + half + d);
  }
}

// Token t at `pos`: rotate its q and k heads in place (when cos_sin is given), store its k and v in the cache;
// for kv heads [h0, h1) and their query heads (default: all).
template <typename T>
void rope_and_store(const AttnArgs& a, const int64_t* table, int64_t t, int64_t pos, const float* cos_sin,
                    int h0 = 0, int h1 = -1) {
  const int D = a.D, G = a.H / a.KVH;
  if (h1 < 0) h1 = a.KVH;
  T* q = static_cast<T*>(a.q) + t * a.q_stride;
  T* k = static_cast<T*>(a.k) + t * a.k_stride;
  const T* v = static_cast<const T*>(a.v) + t * a.v_stride;
  if (cos_sin != nullptr) {
    const float* cs = cos_sin + pos * D;  // [cos(half), sin(half)]
    for (int h = h0 * G; h < h1 * G; h++) rope_head(q + int64_t(h) * D, cs, D);
    for (int h = h0; h < h1; h++) rope_head(k + int64_t(h) * D, cs, D);
  }
  T* kc = static_cast<T*>(const_cast<void*>(a.k_cache));
  T* vc = static_cast<T*>(const_cast<void*>(a.v_cache));
  for (int h = h0; h < h1; h++) {
    const int64_t off = kv_offset(a, table, pos, h);
    memcpy(kc + off, k + int64_t(h) * D, sizeof(T) * D);
    memcpy(vc + off, v + int64_t(h) * D, sizeof(T) * D);
  }
}

template <typename T, int DV>
int attention_impl(const AttnArgs& a, const float* cos_sin, int num_reqs, int num_threads) {
  // Token -> (request, position) for the rope / cache-write phase, and the work items.
  const int64_t T_total = a.query_start[num_reqs];
  const int G = a.H / a.KVH;
  const int tq = std::max(1, MAX_ROWS / G);
  // One-query items (decodes) take several kv heads each, all of them when there are enough requests to keep
  // every thread busy: a chunk of K/V rows is then read in order, once.
  int num_one = 0;
  for (int r = 0; r < num_reqs; r++) num_one += a.query_start[r + 1] - a.query_start[r] == 1;
  const int want_items = 4 * std::max(1, num_threads);
  const int splits = num_one >= want_items ? 1 : std::min(a.KVH, (want_items + std::max(num_one, 1) - 1) / std::max(num_one, 1));
  const int heads_per_item = std::max(1, std::min((a.KVH + splits - 1) / splits, MAX_QROWS / G));
  int n_items = 0;
  for (int r = 0; r < num_reqs; r++) {
    const int n = int(a.query_start[r + 1] - a.query_start[r]);
    n_items += n == 1 ? (a.KVH + heads_per_item - 1) / heads_per_item : a.KVH * ((n + tq - 1) / tq);
  }
  // (On a team, every thread builds the same list for itself: a few microseconds, and nothing to share.)
  Item* items = static_cast<Item*>(malloc(sizeof(Item) * size_t(std::max(n_items, 1))));
  int* req_of_token = static_cast<int*>(malloc(sizeof(int) * size_t(std::max<int64_t>(T_total, 1))));
  if (items == nullptr || req_of_token == nullptr) {
    free(items);
    free(req_of_token);
    return -1;
  }
  int k = 0;
  for (int r = 0; r < num_reqs; r++) {
    const int n = int(a.query_start[r + 1] - a.query_start[r]);
    const int64_t ctx0 = a.seq_lens[r] - n;
    for (int64_t t = a.query_start[r]; t < a.query_start[r + 1]; t++) req_of_token[t] = r;
    if (n == 1) {
      for (int h = 0; h < a.KVH; h += heads_per_item) {
        const int h1 = std::min(a.KVH, h + heads_per_item);
        items[k++] = Item{r, h, h1, 0, 1, int64_t(h1 - h) * G * (ctx0 + 1)};
      }
      continue;
    }
    for (int q0 = 0; q0 < n; q0 += tq) {
      const int q1 = std::min(n, q0 + tq);
      for (int h = 0; h < a.KVH; h++) items[k++] = Item{r, h, h + 1, q0, q1, int64_t(q1 - q0) * G * (ctx0 + q1)};
    }
  }
  // Longest first: with dynamic scheduling the threads then finish close together.
  std::sort(items, items + n_items, [](const Item& x, const Item& y) { return x.cost > y.cost; });
  int64_t work = 0;
  for (int i = 0; i < n_items; i++) work += items[i].cost;
  const int threads = work * a.D < 32768 ? 1 : std::max(1, num_threads);
  // When every request decodes one token, an item's new K/V row and q heads are its own (items split a
  // request by kv heads only): the item ropes and stores them itself, right before it reads them, and the
  // step needs no separate pass and barrier for it.
  const bool item_ropes = num_one == num_reqs;
  on_team(threads, [&] {
    if (!item_ropes) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T_total; t++) {
        const int r = req_of_token[t];
        const int64_t n = a.query_start[r + 1] - a.query_start[r];
        const int64_t pos = a.seq_lens[r] - n + (t - a.query_start[r]);
        rope_and_store<T>(a, a.block_table + r * a.bt_stride, t, pos, cos_sin);
      }
      // the implicit barrier above: every new K/V row is in the cache before any item reads it
    }
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n_items; i++) {
      const Item& it = items[i];
      if (item_ropes)
        rope_and_store<T>(a, a.block_table + it.req * a.bt_stride, a.query_start[it.req], a.seq_lens[it.req] - 1,
                          cos_sin, it.kvh, it.kvh_end);
      attend_item<T, DV>(a, it);
    }
  });
  free(items);
  free(req_of_token);
  return 0;
}

template <typename T>
int attention_dispatch(const AttnArgs& a, const float* cos_sin, int num_reqs, int num_threads) {
  // Head sizes with a compiled variant (each one costs build time); others take the torch path.
  if (a.D == 64) return attention_impl<T, 64 / W>(a, cos_sin, num_reqs, num_threads);
  if (a.D == 128) return attention_impl<T, 128 / W>(a, cos_sin, num_reqs, num_threads);
  return -2;
}

// ---------------------------------------------------------------------------------------------------------
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


// ---------------------------------------------------------------------------------------------------------
// Row-wise argmax for greedy sampling, straight from the logits' dtype (bfloat16 logits need no float32 copy:
// the conversion is exact, so the order is the same). The first maximum wins; a NaN counts as the maximum and
// the first NaN wins (numpy's argmax, which the float32 path uses). Two passes over a row (in cache after the
// first): the maximum, then the first lane equal to it.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  const int64_t nv = n / W * W;
  V mx = V::set1(-INFINITY);
  bool nan = false;
  for (int64_t i = 0; i < nv; i += W) {
    const V v = V::load(x + i);
    nan = nan || V::any_nan(v);
    mx = V::max(mx, v);
  }
  float best = nv > 0 ? mx.hmax() : -INFINITY;
  for (int64_t i = nv; i < n; i++) {
    const float v = to_f32(x[i]);
    nan = nan || v != v;
    best = std::max(best, v);
  }
  if (nan) {
    for (int64_t i = 0; i < n; i++)
      if (to_f32(x[i]) != to_f32(x[i])) return i;
  }
  const V b = V::set1(best);
  for (int64_t i = 0; i < nv; i += W) {
    const int lane = V::first_eq(V::load(x + i), b);
    if (lane >= 0) return i + lane;
  }
  for (int64_t i = nv; i < n; i++)
    if (to_f32(x[i]) == best) return i;
  return 0;  // a row of -inf only: index 0, as numpy
}

template <typename T>
void argmax_rows_impl(const void* x, int64_t x_stride, int64_t rows, int64_t n, int64_t* out, int num_threads) {
  const int threads = rows * n < (1 << 16) ? 1 : std::max(1, num_threads);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; r++) out[r] = argmax_row<T>(static_cast<const T*>(x) + r * x_stride, n);
}

// ---------------------------------------------------------------------------------------------------------
// Skinny GEMM for decode-sized batches: y[M, N] = x[M, K] W^T (+ bias), M small, W streamed once from a packed
// layout: blocks of 16 output columns, k-major inside a block, so each block is one sequential read:
//   float32:  Wp[N / 16][K][16]
//   bfloat16: Wp[N / 16][K / 2][16][2]  (pairs of k per output: VDPBF16PS's operand layout)
// At these shapes the GEMM is bound by how fast W streams from memory; oneDNN's small-M kernels reach a
// fraction of that in float32 (measured in benchmarks/gemm.py), so this loop keeps every load useful.
constexpr int NBLK = 16;  // output columns per packed block
constexpr int SK_ROWS = W == 16 ? 8 : 2;  // rows of x per register tile (AVX2 has 16 registers)

// The two blocks' lines SK_AHEAD k steps (4 KB) ahead, into L2: at one row tile (M <= SK_ROWS) the loop is bound
// by the weight stream, and the hardware prefetcher alone, two streams a block apart, left bandwidth unused
// (a sequential-read probe, 2 threads: 21.6 GB/s plain, 25-29 with a 4-8 KB software prefetch). Measured (30
// SmolLM2 layers + lm_head from DRAM, alternated, best of 8): 1/2/5/8 rows 22.9/26.0/30.0/32.8 -> 20.8/21.3/
// 24.2/24.7 ms (32 and 128 steps ahead: within 3% of 64). Past a block's end it asks for the next block's
// first lines, which this thread reads next under the static schedule.
constexpr int64_t SK_AHEAD = 64;
inline void skinny_prefetch_ahead(const float* wp0, const float* wp1, int64_t k) {
  _mm_prefetch(reinterpret_cast<const char*>(wp0 + (k + SK_AHEAD) * NBLK), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(wp1 + (k + SK_AHEAD) * NBLK), _MM_HINT_T1);
}

// One row tile (R rows) x two column blocks.
template <int R>
inline void skinny_tile_f32(const float* x, int64_t x_stride, const float* wp0, const float* wp1, int64_t K,
                            float* acc_out /* [R][32] */) {
#if defined(CVK_AVX512) || defined(CVK_AVX512BF16)
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    const __m512 w0 = _mm512_loadu_ps(wp0 + k * NBLK), w1 = _mm512_loadu_ps(wp1 + k * NBLK);
    skinny_prefetch_ahead(wp0, wp1, k);
    for (int r = 0; r < R; r++) {
      const __m512 xv = _mm512_set1_ps(x[r * x_stride + k]);
      a0[r] = _mm512_fmadd_ps(xv, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(xv, w1, a1[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    _mm512_storeu_ps(acc_out + r * 32, a0[r]);
    _mm512_storeu_ps(acc_out + r * 32 + 16, a1[r]);
  }
#else
  // AVX2: the same, each 16-column block as two halves
  __m256 a[R][4];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4; c++) a[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    const __m256 w[4] = {_mm256_loadu_ps(wp0 + k * NBLK), _mm256_loadu_ps(wp0 + k * NBLK + 8),
                         _mm256_loadu_ps(wp1 + k * NBLK), _mm256_loadu_ps(wp1 + k * NBLK + 8)};
    skinny_prefetch_ahead(wp0, wp1, k);
    for (int r = 0; r < R; r++) {
      const __m256 xv = _mm256_set1_ps(x[r * x_stride + k]);
      for (int c = 0; c < 4; c++) a[r][c] = _mm256_fmadd_ps(xv, w[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc_out + r * 32 + 8 * c, a[r][c]);
#endif
}

// bfloat16: x pairs (x[2k], x[2k+1]) against packed W pairs.
template <int R>
inline void skinny_tile_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* wp0, const uint16_t* wp1,
                             int64_t K, float* acc_out) {
  const int64_t K2 = K / 2;
#if defined(CVK_AVX512BF16)
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; k++) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp0 + k * 2 * NBLK);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp1 + k * 2 * NBLK);
    for (int r = 0; r < R; r++) {
      uint32_t pair;
      memcpy(&pair, x + r * x_stride + 2 * k, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(pair));
      a0[r] = _mm512_dpbf16_ps(a0[r], xv, w0);
      a1[r] = _mm512_dpbf16_ps(a1[r], xv, w1);
    }
  }
  for (int r = 0; r < R; r++) {
    _mm512_storeu_ps(acc_out + r * 32, a0[r]);
    _mm512_storeu_ps(acc_out + r * 32 + 16, a1[r]);
  }
#else
  // No bf16 arithmetic: split each pair into its even-k and odd-k float32 halves (a shift and a mask).
  float acc[R][32];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 32; c++) acc[r][c] = 0.f;
  for (int half = 0; half < 2; half++) {
    const uint16_t* wp = half ? wp1 : wp0;
    for (int c0 = 0; c0 < NBLK; c0 += W) {
      V a[R];
      for (int r = 0; r < R; r++) a[r] = V::zero();
      for (int64_t k = 0; k < K2; k++) {
        // 16 outputs x 2 k as 32 bf16; this vector's W outputs: lanes c0 .. c0 + W
        const uint16_t* src = wp + k * 2 * NBLK + 2 * c0;
#if defined(CVK_AVX512)
        const __m512i pairs = _mm512_loadu_si512(src);
        const V we = {_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16))};
        const V wo = {_mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int(0xffff0000u))))};
#else
        const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        const V we = {_mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16))};
        const V wo = {_mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xffff0000u))))};
#endif
        for (int r = 0; r < R; r++) {
          a[r] = V::fma(V::set1(to_f32(x[r * x_stride + 2 * k])), we, a[r]);
          a[r] = V::fma(V::set1(to_f32(x[r * x_stride + 2 * k + 1])), wo, a[r]);
        }
      }
      for (int r = 0; r < R; r++) a[r].store(acc[r] + half * 16 + c0);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 32; c++) acc_out[r * 32 + c] = acc[r][c];
#endif
}

template <typename T>
void skinny_store(const float* acc, int R, const T* bias, int64_t n0, int64_t N, T* y, int64_t y_stride,
                  int acc_stride = 32) {
  const int nc = int(std::min<int64_t>(32, N - n0));
#if defined(CVK_AVX512) || defined(CVK_AVX512BF16)
  if constexpr (sizeof(T) == 4) {  // float32: two masked vector stores per row (a scalar loop costs ~10% at 96 rows)
    const __mmask16 m0 = nc >= 16 ? __mmask16(0xffff) : __mmask16((1u << nc) - 1);
    const __mmask16 m1 = nc >= 32 ? __mmask16(0xffff) : nc <= 16 ? __mmask16(0) : __mmask16((1u << (nc - 16)) - 1);
    const float* b = reinterpret_cast<const float*>(bias);
    const __m512 b0 = b ? _mm512_maskz_loadu_ps(m0, b + n0) : _mm512_setzero_ps();
    const __m512 b1 = b ? _mm512_maskz_loadu_ps(m1, b + n0 + 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
      float* out = reinterpret_cast<float*>(y) + r * y_stride + n0;
      _mm512_mask_storeu_ps(out, m0, _mm512_add_ps(_mm512_loadu_ps(acc + r * acc_stride), b0));
      _mm512_mask_storeu_ps(out + 16, m1, _mm512_add_ps(_mm512_loadu_ps(acc + r * acc_stride + 16), b1));
    }
    return;
  }
#endif
  for (int r = 0; r < R; r++)
    for (int c = 0; c < nc; c++) {
      const float b = bias ? to_f32(bias[n0 + c]) : 0.f;
      from_f32(acc[r * acc_stride + c] + b, y + r * y_stride + n0 + c);
    }
}

#if defined(CVK_AVX512) || defined(CVK_AVX512BF16)
// float32 past one row tile (M > SK_ROWS), where the GEMM turns compute-bound. The one-tile loop above re-reads a
// column pair's W (2 x K x 64 B: 64-180 KB, past L1) from L2 for every row tile and keeps 8 row pointers live,
// which spills them; here K is split into chunks whose W (2 or 4 blocks x SK_KC x 64 B = 16 or 32 KB) stays in
// L1 while every row tile passes over it, the thread's next unit of W is prefetched over this unit's passes
// (UnitPrefetch), and x is packed once per call k-major per tile (xp[tile][k][rows]: one pointer, a broadcast per
// row at fixed offsets).
// Each output still sums k = 0 .. K-1 in order in one float32 accumulator (stored and reloaded between chunks,
// which is exact), so results are bit-identical to the one-tile loop. Measured (alternated A/B in one process, bench model shapes incl. lm_head,
// 2 threads, a noisy machine): 16 rows 111 -> 121 GFLOP/s, 48 rows 119 -> 131, 96 rows 121 -> 128 (best of 8);
// the chunk size (64/128/256) made no difference beyond the noise.
constexpr int64_t SK_KC = 128;

// Streams the weights of a thread's next unit (its NB blocks: one contiguous run of lines) into L2 while the
// current unit computes, a few lines per k step at the rate that spreads the whole run over the unit's passes
// (row tiles x K steps). Asking for the next chunk of the same unit during the first tile's pass only, as this
// loop did before, bunched the requests into a quarter of the time at 32 rows, and the later passes, served
// from L1, left memory idle: DRAM-resident weights (30 SmolLM2 layers + lm_head, alternated A/B, best of 8)
// 16 rows 30.4 -> 27.4 ms, 32 rows 44.3 -> 34.1, 48 rows 59.7 -> 49.3, 86 rows 96.2 -> 85.1. Into L1 (T0) it
// evicted the chunk the later tiles re-read (9 rows 22% slower).
struct UnitPrefetch {
  const char* next = nullptr;  // null: the thread has no next unit
  int64_t line = 0, lines = 0;
  uint32_t acc = 0, rate = 0;  // lines per k step, 16.16 fixed point
  inline void step() {
    for (acc += rate; acc >= 65536u; acc -= 65536u, line++)
      if (line < lines) _mm_prefetch(next + line * 64, _MM_HINT_T1);
  }
};

// One row tile (R <= TR rows, x packed [k][TR]) x NB column blocks over kc values of k, accumulating into
// acc [R][NB * 16] (zeroed first on the first chunk). pf: the next unit's weights, a step of it per k.
template <int NB, int TR, int R>
inline void skinny_tile_f32_packed(const float* xp, const float* const* w, int64_t kc, float* acc, bool first,
                                   UnitPrefetch& pf) {
  __m512 a[R][NB];
  for (int r = 0; r < R; r++)
    for (int b = 0; b < NB; b++) a[r][b] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + (r * NB + b) * 16);
  for (int64_t k = 0; k < kc; k++) {
    __m512 wv[NB];
    for (int b = 0; b < NB; b++) wv[b] = _mm512_loadu_ps(w[b] + k * NBLK);
    if (pf.next) pf.step();
    for (int r = 0; r < R; r++) {
      const __m512 xv = _mm512_set1_ps(xp[k * TR + r]);
      for (int b = 0; b < NB; b++) a[r][b] = _mm512_fmadd_ps(xv, wv[b], a[r][b]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int b = 0; b < NB; b++) _mm512_store_ps(acc + (r * NB + b) * 16, a[r][b]);
}

// The k-chunked loop over units of NB column blocks (NB x 16 outputs) and row tiles of TR rows.
template <int NB, int TR>
void skinny_gemm_f32_units(const float* x, int64_t x_stride, int64_t M, const float* wp, const float* bias, float* y,
                           int64_t y_stride, int64_t N, int64_t K, int threads) {
  const int64_t nblocks = (N + NBLK - 1) / NBLK, nunits = (nblocks + NB - 1) / NB, block_elems = K * NBLK;
  const int64_t tiles = (M + TR - 1) / TR;
  on_team(threads, [&] {
    // x packed once, into one thread's buffer that the whole team reads (a team's threads are its own, so
    // two engines calling from two threads never share one)
    static thread_local std::vector<float> packed_x;
    float* xp;
#pragma omp single copyprivate(xp)
    {
      packed_x.resize(size_t(tiles * K * TR));
      xp = packed_x.data();
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const int64_t rows = std::min<int64_t>(TR, M - t * TR);
      float* dst = xp + t * K * TR;
      for (int64_t r = 0; r < rows; r++) {
        const float* src = x + (t * TR + r) * x_stride;
        for (int64_t k = 0; k < K; k++) dst[k * TR + r] = src[k];
      }
    }  // (implicit barrier: every tile is packed before any is read)
    static thread_local std::vector<float, AlignedAlloc<float>> acc_buf;
    acc_buf.resize(size_t(tiles * TR * NB * 16));
    float* acc = acc_buf.data();
    // One contiguous range of units per thread (schedule(static), made explicit: the prefetch must know which
    // unit this thread takes next).
    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t u_end = nunits * (tid + 1) / nt;
    for (int64_t u = nunits * tid / nt; u < u_end; u++) {
      const float* w[NB];
      for (int b = 0; b < NB; b++)  // blocks past the last repeat it (computed, never stored)
        w[b] = wp + std::min(NB * u + b, nblocks - 1) * block_elems;
      UnitPrefetch pf;
      if (u + 1 < u_end) {  // a unit's blocks are adjacent in the packed layout: one run of K lines per block
        const int64_t next_blocks = std::min<int64_t>(NB, nblocks - NB * (u + 1));
        pf.next = reinterpret_cast<const char*>(wp + NB * (u + 1) * block_elems);
        pf.lines = next_blocks * K;
        pf.rate = uint32_t(next_blocks * 65536 / tiles);
      }
      for (int64_t k0 = 0; k0 < K; k0 += SK_KC) {
        const int64_t kc = std::min(SK_KC, K - k0);
        const float* wk[NB];
        for (int b = 0; b < NB; b++) wk[b] = w[b] + k0 * NBLK;
        for (int64_t t = 0; t < tiles; t++) {
          const float* xt = xp + (t * K + k0) * TR;
          float* at = acc + t * TR * NB * 16;
          const bool first = k0 == 0;
          switch (std::min<int64_t>(TR, M - t * TR)) {
#define CVK_UNIT_CASE(RR) \
  case RR: if constexpr (RR <= TR) skinny_tile_f32_packed<NB, TR, RR>(xt, wk, kc, at, first, pf); break;
            CVK_UNIT_CASE(1) CVK_UNIT_CASE(2) CVK_UNIT_CASE(3) CVK_UNIT_CASE(4) CVK_UNIT_CASE(5) CVK_UNIT_CASE(6)
            CVK_UNIT_CASE(7) CVK_UNIT_CASE(8)
#undef CVK_UNIT_CASE
            default: break;
          }
        }
      }
      for (int64_t t = 0; t < tiles; t++)
        for (int h = 0; h < NB / 2; h++)
          if (NB * u * NBLK + 32 * h < N)
            skinny_store<float>(acc + t * TR * NB * 16 + h * 32, int(std::min<int64_t>(TR, M - t * TR)), bias,
                                NB * u * NBLK + 32 * h, N, y + t * TR * y_stride, y_stride, NB * 16);
    }
#pragma omp barrier
    // (the loop's own barrier, which its omp for had: inside the layer stack the next phase reads y)
  });
}

void skinny_gemm_f32_blocked(const float* x, int64_t x_stride, int64_t M, const float* wp, const float* bias, float* y,
                             int64_t y_stride, int64_t N, int64_t K, int threads) {
  // Units of four blocks (6 rows x 64 columns: 24 accumulators, 10 loads per 24 FMAs instead of 10 per 16) from
  // 40 rows, where the 6-row tiles pad little; with enough units that the threads get even shares (within 1/16).
  // Alternated A/B, bench model shapes + lm_head, 2 threads: 40 rows 10.74 -> 10.60 ms, 64 rows 17.21 -> 16.37,
  // 86 rows 22.98 -> 21.83; at 9-16 rows they were slower (4.66 -> 5.16 ms at 16), so those keep the pairs.
  const int64_t nblocks = (N + NBLK - 1) / NBLK, quads = (nblocks + 3) / 4;
  if (M >= 40 && quads >= 4 * threads && (quads + threads - 1) / threads * threads * 15 <= quads * 16)
    skinny_gemm_f32_units<4, 6>(x, x_stride, M, wp, bias, y, y_stride, N, K, threads);
  else
    skinny_gemm_f32_units<2, SK_ROWS>(x, x_stride, M, wp, bias, y, y_stride, N, K, threads);
}
#endif

template <typename T>
void skinny_gemm_impl(const T* x, int64_t x_stride, int64_t M, const T* wp, const T* bias, T* y, int64_t y_stride,
                      int64_t N, int64_t K, int num_threads) {
  const int64_t nblocks = (N + NBLK - 1) / NBLK;
  const int64_t npairs = (nblocks + 1) / 2;  // work unit: two column blocks (32 outputs)
  const int64_t block_elems = K * NBLK;
  const int threads = npairs < 4 ? 1 : std::max(1, num_threads);
#if defined(CVK_AVX512) || defined(CVK_AVX512BF16)
  if constexpr (sizeof(T) == 4) {
    if (M > SK_ROWS) {
      skinny_gemm_f32_blocked(reinterpret_cast<const float*>(x), x_stride, M, reinterpret_cast<const float*>(wp),
                              reinterpret_cast<const float*>(bias), reinterpret_cast<float*>(y), y_stride, N, K,
                              threads);
      return;
    }
  }
#endif
  on_team(threads, [&] {
#pragma omp for schedule(static)
  for (int64_t p = 0; p < npairs; p++) {
    alignas(64) float acc[SK_ROWS * 32];
    const T* w0 = wp + 2 * p * block_elems;
    const T* w1 = 2 * p + 1 < nblocks ? w0 + block_elems : w0;  // an odd last block pairs with itself
    for (int64_t m0 = 0; m0 < M; m0 += SK_ROWS) {
      const int R = int(std::min<int64_t>(SK_ROWS, M - m0));
      const T* xr = x + m0 * x_stride;
#define CVK_SKINNY_CASE(RR)                                                                            \
  case RR:                                                                                             \
    if constexpr (sizeof(T) == 4)                                                                      \
      skinny_tile_f32<RR>(reinterpret_cast<const float*>(xr), x_stride, reinterpret_cast<const float*>(w0), \
                          reinterpret_cast<const float*>(w1), K, acc);                                \
    else                                                                                               \
      skinny_tile_bf16<RR>(reinterpret_cast<const uint16_t*>(xr), x_stride,                           \
                           reinterpret_cast<const uint16_t*>(w0), reinterpret_cast<const uint16_t*>(w1), K, acc); \
    break;
      switch (R) {
        CVK_SKINNY_CASE(1)
        CVK_SKINNY_CASE(2)
        CVK_SKINNY_CASE(3)
        CVK_SKINNY_CASE(4)
#if defined(CVK_AVX512) || defined(CVK_AVX512BF16)
        CVK_SKINNY_CASE(5)
        CVK_SKINNY_CASE(6)
        CVK_SKINNY_CASE(7)
        CVK_SKINNY_CASE(8)
#endif
      }
#undef CVK_SKINNY_CASE
      skinny_store<T>(acc, R, bias, 2 * p * NBLK, N, y + m0 * y_stride, y_stride);
    }
  }  });
}


#if defined(CVK_AVX512BF16)
// Row count up to which amx_gemm_bf16 (below) asks for the next pair's weights itself. 30 SmolLM2 layers +
// lm_head from DRAM, alternated in one process (best of 6), ms at 33 / 48 / 64 / 96 / 112 / 128 rows: 18.1 /
// 20.5 / 22.9 / 23.5 / 35.5 / 36.0 with the prefetch, 15.6 / 16.9 / 17.7 / 22.1 / 28.0 / 30.5 without; at 17-32
// rows the same; the whole SmolLM2 bfloat16 workload 12.62 -> 12.14 s (best of 4 alternated pairs).
constexpr int64_t AMX_PREFETCH_ROWS = 32;

// ---------------------------------------------------------------------------------------------------------
// AMX (Sapphire Rapids and later): the same skinny GEMM in bfloat16 on tile registers. A tile of 16 x's rows x
// 32 k against a tile of the packed weight (16 k-pairs x 16 columns: the layout above, so one 1 KB load) gives
// a 16 x 16 float32 block per TDPBF16PS. Weights stream once per 32 rows of x; up to 32 rows the loop is bound
// by that stream (oneDNN's AMX kernels reach about half of it at 17-128 rows: README); above, each pass re-reads
// its x rows from L2 for every pair of column blocks, and that traffic grows with the rows.
// Tiles: 0, 1 = x rows [m0, m0+16), [m0+16, m0+32); 2, 3 = two weight column blocks; 4-7 = the four results.
// swiglu: the packed weight is a fused gate_up projection (2 N columns, gate then up) and y [M, N] gets
// silu(gate) * up. A unit is then gate block b with its up block (N / 16 blocks on), so the product is formed
// in the epilogue from the two results rounded to bfloat16 as a plain gate_up GEMM stores them, in
// silu_mul_impl's arithmetic: bit-identical to the two calls, without the [M, 2 N] round trip or their
// barrier. Needs N % 16 == 0.
__attribute__((target("amx-tile,amx-bf16")))
void amx_gemm_bf16(const uint16_t* x, int64_t x_stride, int64_t M, const uint16_t* wp, const uint16_t* bias,
                   uint16_t* y, int64_t y_stride, int64_t N, int64_t K, int num_threads, bool swiglu = false) {
  const int64_t nblocks = (N + NBLK - 1) / NBLK, npairs = swiglu ? nblocks : (nblocks + 1) / 2;
  const int64_t block_elems = K * NBLK;
  const int threads = npairs < 4 ? 1 : std::max(1, num_threads);
  // (the lambda is a function of its own: it needs the AMX target too)
  on_team(threads, [&]() __attribute__((target("amx-tile,amx-bf16"))) {
    alignas(64) float c[4][16 * 16];
    int rows0 = -1, rows1 = -1;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < npairs; p++) {
      const uint16_t* w0 = wp + (swiglu ? p : 2 * p) * block_elems;
      const uint16_t* w1 = swiglu ? w0 + nblocks * block_elems : 2 * p + 1 < nblocks ? w0 + block_elems : w0;
      // The next pair's weights, asked for into L2 while this pair runs, spread over all its row groups (group
      // g of G takes every G-th line of a k step's share: asked for in the first group only, at 86-96 rows the
      // requests came in a third of the pair's time), so only a layer's first pair waits on memory. (Plain: the
      // two blocks follow each other; swiglu: 1 KB of each of the two per k step. At the present limit there is
      // one group, but the share-out stays: written without it, with a constant stride, the kernel ran 8-12%
      // slower at 8-32 rows in either order of an alternated A/B, its prefetch and tile loops alike in the
      // disassembly: code placement, most likely.) Only up to AMX_PREFETCH_ROWS
      // rows: with more, the tile loads of the x rows (and of the pair's weights for the later groups) miss L1
      // too, and the prefetches queued behind them for the line fill buffers stalled the loop (perf, 64 rows: a
      // third of the samples on them); the hardware prefetcher alone streamed the weights faster.
      const char* next = p + 1 < npairs && M <= AMX_PREFETCH_ROWS
                             ? reinterpret_cast<const char*>(w0 + (swiglu ? 1 : 2) * block_elems) : nullptr;
      const int64_t twin = nblocks * block_elems * 2;  // swiglu: bytes from a gate block to its up block
      const int64_t groups = (M + 31) / 32;            // row groups of 32 x rows: the prefetch is shared out over them
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int r0 = int(std::min<int64_t>(16, M - m0)), r1 = int(std::max<int64_t>(0, std::min<int64_t>(16, M - m0 - 16)));
        if (r0 != rows0 || r1 != rows1) {
          amx_configure(r0, r1);
          rows0 = r0;
          rows1 = r1;
        }
        const int64_t g = m0 / 32;  // this row group's share of the next pair's lines
        const uint16_t* xa = x + m0 * x_stride;
        const uint16_t* xb = xa + 16 * x_stride;
        const int64_t xs = x_stride * 2;
        _tile_zero(4);
        _tile_zero(5);
        if (r1) {
          _tile_zero(6);
          _tile_zero(7);
        }
        for (int64_t k = 0; k < K; k += 32) {
          if (next) {
            // this k step reads 2 x 1 KB of its pair: 2 KB of the next pair's (both blocks in order) are asked
            // for over the pair's row groups, this one taking lines g, g + groups, ...
            if (swiglu) {
              for (int64_t b = k * NBLK * 2 + 64 * g; b < k * NBLK * 2 + 1024; b += 64 * groups) {
                _mm_prefetch(next + b, _MM_HINT_T1);
                _mm_prefetch(next + twin + b, _MM_HINT_T1);
              }
            } else {
              const int64_t off = k * NBLK * 4;
              const int64_t next_bytes = std::min<int64_t>(2, nblocks - 2 * (p + 1)) * block_elems * 2;
              for (int64_t b = off + 64 * g; b < std::min(off + 2048, next_bytes); b += 64 * groups) _mm_prefetch(next + b, _MM_HINT_T1);
            }
          }
          _tile_loadd(0, xa + k, xs);
          _tile_loadd(2, w0 + k * NBLK, 64);
          _tile_loadd(3, w1 + k * NBLK, 64);
          _tile_dpbf16ps(4, 0, 2);
          _tile_dpbf16ps(5, 0, 3);
          if (r1) {
            _tile_loadd(1, xb + k, xs);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
          }
        }
        _tile_stored(4, c[0], 64);
        _tile_stored(5, c[1], 64);
        if (r1) {
          _tile_stored(6, c[2], 64);
          _tile_stored(7, c[3], 64);
        }
        if (swiglu) {
          const int64_t n0 = p * NBLK;
          const V one = V::set1(1.f);
          alignas(64) uint16_t gb[16], ub[16];
          for (int half = 0; half < 2; half++)
            for (int r = 0; r < (half ? r1 : r0); r++) {
              V g = V::load(c[2 * half] + r * 16), u = V::load(c[2 * half + 1] + r * 16);
              if (bias) {
                g = g + V::load(bias + n0);
                u = u + V::load(bias + N + n0);
              }
              g.store(gb);  // rounded to bfloat16, as the gate_up output would hold them
              u.store(ub);
              g = V::load(gb);
              const V sg = g * V::rcp(one + V::exp(V::zero() - g));
              (sg * V::load(ub)).store(y + (m0 + 16 * half + r) * y_stride + n0);
            }
          continue;
        }
        const int64_t n0 = 2 * p * NBLK;
        const int nc = int(std::min<int64_t>(32, N - n0));
        for (int half = 0; half < 2; half++) {
          const int rows = half ? r1 : r0;
          for (int r = 0; r < rows; r++) {
            uint16_t* dst = y + (m0 + 16 * half + r) * y_stride + n0;
            for (int b = 0; b < 2; b++) {
              const int cols = std::min(16, nc - 16 * b);
              if (cols <= 0) break;
              const float* src = c[2 * half + b] + r * 16;
              if (cols == 16) {
                V v = V::load(src);
                if (bias) v = v + V::load(bias + n0 + 16 * b);
                v.store(dst + 16 * b);
              } else {
                for (int j = 0; j < cols; j++)
                  from_f32(src[j] + (bias ? to_f32(bias[n0 + 16 * b + j]) : 0.f), dst + 16 * b + j);
              }
            }
          }
        }
      }
    }
    if (rows0 >= 0) _tile_release();
  });
}
#endif

}  // namespace

extern "C" {

int cvk_abi_version() { return 4; }

int cvk_vector_width() { return W; }

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
  if (D > MAX_D || H % KVH != 0 || H / KVH > MAX_G || H / KVH > MAX_ROWS) return -2;
  const AttnArgs a{q, q_stride, k, k_stride, v, v_stride, k_cache, v_cache, block_table, bt_stride, query_start,
                   seq_lens, out, out_stride, H, KVH, D, bs, scale};
  if (dtype == 0) return attention_dispatch<float>(a, cos_sin, num_reqs, num_threads);
  if (dtype == 1) return attention_dispatch<uint16_t>(a, cos_sin, num_reqs, num_threads);
  return -3;
}

// residual <- x + residual; out <- rmsnorm(residual) * weight (add == 0: out <- rmsnorm(x) * weight).
// x rows are x_stride elements apart; residual, out and weight are dense. Returns 0, -3 for a bad dtype.
int cvk_add_rmsnorm(int dtype, const void* x, int64_t x_stride, void* residual, const void* weight, void* out,
                    int64_t rows, int64_t n, float eps, int add, int num_threads) {
  if (dtype == 0) add_rmsnorm_impl<float>(x, x_stride, residual, weight, out, rows, n, eps, add != 0, num_threads);
  else if (dtype == 1) add_rmsnorm_impl<uint16_t>(x, x_stride, residual, weight, out, rows, n, eps, add != 0, num_threads);
  else return -3;
  return 0;
}


// y[M, N] (+)= x[M, K] W^T + bias for small M, W packed by the caller into 16-column blocks (see
// skinny_gemm_impl: float32 [N/16][K][16], bfloat16 [N/16][K/2][16][2], N padded to 16 with zero columns;
// bfloat16 needs K even). bias: N values of the same dtype, or NULL. Returns 0, -3 for a bad dtype/shape.
int cvk_skinny_gemm(int dtype, const void* x, int64_t x_stride, int64_t M, const void* packed, const void* bias,
                    void* y, int64_t y_stride, int64_t N, int64_t K, int num_threads) {
  if (M <= 0 || N <= 0) return 0;
  if (dtype == 0)
    skinny_gemm_impl<float>(static_cast<const float*>(x), x_stride, M, static_cast<const float*>(packed),
                            static_cast<const float*>(bias), static_cast<float*>(y), y_stride, N, K, num_threads);
  else if (dtype == 1 && K % 2 == 0)
    skinny_gemm_impl<uint16_t>(static_cast<const uint16_t*>(x), x_stride, M, static_cast<const uint16_t*>(packed),
                               static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), y_stride, N, K,
                               num_threads);
  else
    return -3;
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
#if defined(CVK_AVX512BF16) && defined(__linux__)
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  g_amx_attention = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return g_amx_attention ? 1 : 0;
#else
  return 0;
#endif
}

// Prefill attention's QK^T on AMX (bfloat16) on or off (after cvk_amx_init granted AMX); returns the setting.
int cvk_set_amx_attention(int on) {
#if defined(CVK_AVX512BF16)
  static const bool granted = g_amx_attention;  // the first call remembers what cvk_amx_init obtained
  g_amx_attention = granted && on != 0;
  return g_amx_attention ? 1 : 0;
#else
  (void)on;
  return 0;
#endif
}

// The bfloat16 skinny GEMM on AMX (call cvk_amx_init first): as cvk_skinny_gemm, K a multiple of 32.
int cvk_amx_gemm(const void* x, int64_t x_stride, int64_t M, const void* packed, const void* bias, void* y,
                 int64_t y_stride, int64_t N, int64_t K, int num_threads) {
#if defined(CVK_AVX512BF16)
  if (M <= 0 || N <= 0) return 0;
  if (K % 32 != 0) return -3;
  amx_gemm_bf16(static_cast<const uint16_t*>(x), x_stride, M, static_cast<const uint16_t*>(packed),
                static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), y_stride, N, K, num_threads);
  return 0;
#else
  return -2;
#endif
}

// out[r] <- the index of the first maximum of row r of x [rows, n] (row stride x_stride elements).
int cvk_argmax_rows(int dtype, const void* x, int64_t x_stride, int64_t rows, int64_t n, int64_t* out,
                    int num_threads) {
  if (dtype == 0) argmax_rows_impl<float>(x, x_stride, rows, n, out, num_threads);
  else if (dtype == 1) argmax_rows_impl<uint16_t>(x, x_stride, rows, n, out, num_threads);
  else return -3;
  return 0;
}

// out [rows, n] <- silu(gate_up[:, :n]) * gate_up[:, n:].
int cvk_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t n, int num_threads) {
  if (dtype == 0) silu_mul_impl<float>(gate_up, out, rows, n, num_threads);
  else if (dtype == 1) silu_mul_impl<uint16_t>(gate_up, out, rows, n, num_threads);
  else return -3;
  return 0;
}


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

int cvk_llama_layers(int dtype, int use_amx, int64_t T, int L, int64_t hidden, int64_t inter,
                     const int64_t* fields, void* x, void* residual, void* h, void* qkv, void* attn,
                     void* gu, void* act, const int64_t* block_table, int64_t bt_stride,
                     const int64_t* query_start, const int64_t* seq_lens, int num_reqs, const float* cos_sin, int H,
                     int KVH, int D, int bs, float scale, float eps, int num_threads) {
  if (T <= 0) return 0;
  if (dtype != 0 && dtype != 1) return -3;
#if !defined(CVK_AVX512BF16)
  if (dtype == 1) return -2;
#endif
  if (dtype == 1 && (!use_amx || hidden % 32 != 0 || inter % 32 != 0 || (int64_t(H) * D) % 32 != 0)) return -3;
  if (D > MAX_D || H % KVH != 0 || H / KVH > MAX_G || H / KVH > MAX_ROWS) return -2;
  const int64_t es = dtype == 0 ? 4 : 2;
  const int64_t qkv_n = int64_t(H + 2 * KVH) * D, q_n = int64_t(H) * D;
  auto ptr = [&](int field, int layer) { return reinterpret_cast<const void*>(fields[int64_t(field) * L + layer]); };
  auto gemm = [&](const void* in, int64_t K, int layer, int wf, int bf, void* out, int64_t N) {
    if (dtype == 0) {
      skinny_gemm_impl<float>(static_cast<const float*>(in), K, T, static_cast<const float*>(ptr(wf, layer)),
                              static_cast<const float*>(ptr(bf, layer)), static_cast<float*>(out), N, N, K,
                              num_threads);
    } else {
#if defined(CVK_AVX512BF16)
      amx_gemm_bf16(static_cast<const uint16_t*>(in), K, T, static_cast<const uint16_t*>(ptr(wf, layer)),
                    static_cast<const uint16_t*>(ptr(bf, layer)), static_cast<uint16_t*>(out), N, N, K, num_threads);
#endif
    }
  };
  auto norm = [&](const void* in, const void* w, bool add) {
    if (dtype == 0) add_rmsnorm_impl<float>(in, hidden, residual, w, h, T, hidden, eps, add, num_threads);
    else add_rmsnorm_impl<uint16_t>(in, hidden, residual, w, h, T, hidden, eps, add, num_threads);
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
    const int arc = dtype == 0 ? attention_dispatch<float>(a, cos_sin, num_reqs, num_threads)
                               : attention_dispatch<uint16_t>(a, cos_sin, num_reqs, num_threads);
    if (arc != 0) {  // the same on every thread (the inputs decide it), so the team stops together
#pragma omp atomic write
      rc = arc;
      break;
    }
    gemm(attn, q_n, l, LW_O, LW_O_B, x, hidden);
    norm(x, ptr(LW_POST_NORM, l), true);
    if (dtype == 0) {
      gemm(h, hidden, l, LW_GU, LW_GU_B, gu, 2 * inter);
      silu_mul_impl<float>(gu, act, T, inter, num_threads);
    } else {
#if defined(CVK_AVX512BF16)
      amx_gemm_bf16(static_cast<const uint16_t*>(h), hidden, T, static_cast<const uint16_t*>(ptr(LW_GU, l)),
                    static_cast<const uint16_t*>(ptr(LW_GU_B, l)), static_cast<uint16_t*>(act), inter, inter, hidden,
                    num_threads, /*swiglu=*/true);
#endif
    }
    gemm(act, inter, l, LW_DOWN, LW_DOWN_B, x, hidden);
  }
  return rc;
}

}  // extern "C"
