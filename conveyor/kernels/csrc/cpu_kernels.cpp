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

#include <algorithm>

namespace {

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
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
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
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
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
// Attention. One work item = (request, kv head, tile of queries): its G query heads x up to TQ queries share
// every K/V row they read. Keys are walked in chunks of KC with an online softmax (flash-attention style),
// so no score buffer grows with the context, and K/V rows are read straight from the paged cache.
constexpr int KC = 32;         // keys per chunk
constexpr int MAX_ROWS = 32;   // query rows (queries x heads of a group) per item
constexpr int MAX_D = 256;

struct AttnArgs {
  const void* qkv; int64_t qkv_stride;
  const void* k_cache; const void* v_cache;
  const int64_t* block_table; int64_t bt_stride;
  const int64_t* query_start; const int64_t* seq_lens;
  void* out; int64_t out_stride;
  int H, KVH, D, bs;
  float scale;
};

struct Item {
  int req, kvh, q0, q1;  // queries [q0, q1) of request req (indices within the request's chunk)
  int64_t cost;
};

// S[r][j] = q_r . k_j for rows r < nrows, keys j < nk. q rows are float32 (scaled), k rows of type T.
template <typename T, int DV>
inline void qk_chunk(const float* q, int nrows, const T* const* krow, int nk, float* S) {
  for (int j = 0; j < nk; j++) {
    V k[DV];
    for (int d = 0; d < DV; d++) k[d] = V::load(krow[j] + d * W);
    int r = 0;
    for (; r + 2 <= nrows; r += 2) {
      const float* q0 = q + r * DV * W;
      const float* q1 = q0 + DV * W;
      V a0 = V::zero(), a1 = V::zero();
      for (int d = 0; d < DV; d++) {
        a0 = V::fma(V::load(q0 + d * W), k[d], a0);
        a1 = V::fma(V::load(q1 + d * W), k[d], a1);
      }
      S[r * KC + j] = a0.sum();
      S[(r + 1) * KC + j] = a1.sum();
    }
    for (; r < nrows; r++) {
      const float* q0 = q + r * DV * W;
      V a0 = V::zero();
      for (int d = 0; d < DV; d++) a0 = V::fma(V::load(q0 + d * W), k[d], a0);
      S[r * KC + j] = a0.sum();
    }
  }
}

// O[r] += sum_j P[r][j] * v_j, rows in groups of RB so the accumulators stay in registers.
template <typename T, int DV, int RB>
inline void pv_rows(const float* P, const T* const* vrow, int nk, float* O, int r0) {
  V acc[RB][DV];
  for (int i = 0; i < RB; i++)
    for (int d = 0; d < DV; d++) acc[i][d] = V::load(O + (r0 + i) * DV * W + d * W);
  for (int j = 0; j < nk; j++) {
    V v[DV];
    for (int d = 0; d < DV; d++) v[d] = V::load(vrow[j] + d * W);
    for (int i = 0; i < RB; i++) {
      V p = V::set1(P[(r0 + i) * KC + j]);
      for (int d = 0; d < DV; d++) acc[i][d] = V::fma(p, v[d], acc[i][d]);
    }
  }
  for (int i = 0; i < RB; i++)
    for (int d = 0; d < DV; d++) acc[i][d].store(O + (r0 + i) * DV * W + d * W);
}

template <typename T, int DV>
inline void pv_chunk(const float* P, int nrows, const T* const* vrow, int nk, float* O) {
  constexpr int RB = DV <= 4 ? 4 : (DV <= 8 ? 2 : 1);
  int r = 0;
  for (; r + RB <= nrows; r += RB) pv_rows<T, DV, RB>(P, vrow, nk, O, r);
  for (; r < nrows; r++) pv_rows<T, DV, 1>(P, vrow, nk, O, r);
}

template <typename T, int DV>
void attend_item(const AttnArgs& a, const Item& it) {
  constexpr int D = DV * W;
  const int G = a.H / a.KVH;
  const int64_t qs = a.query_start[it.req];
  const int n_new = int(a.query_start[it.req + 1] - qs);
  const int64_t seq_len = a.seq_lens[it.req];
  const int64_t ctx0 = seq_len - n_new;  // position of the request's first new query
  const int nq = it.q1 - it.q0, nrows = nq * G;
  const int64_t* table = a.block_table + int64_t(it.req) * a.bt_stride;
  const int64_t row_elems = int64_t(a.KVH) * D;  // one token's K (or V) in a block, all kv heads
  const T* kc = static_cast<const T*>(a.k_cache) + int64_t(it.kvh) * D;
  const T* vc = static_cast<const T*>(a.v_cache) + int64_t(it.kvh) * D;

  alignas(64) float q[MAX_ROWS * D];
  alignas(64) float O[MAX_ROWS * D];
  alignas(64) float S[MAX_ROWS * KC];
  float m[MAX_ROWS], l[MAX_ROWS];
  int64_t last_key[MAX_ROWS];  // row r sees keys 0 .. last_key[r]
  const T* krow[KC];
  const T* vrow[KC];

  // Row r = query (q0 + r / G), head (kvh * G + r % G); queries are pre-scaled.
  const V scale = V::set1(a.scale);
  for (int r = 0; r < nrows; r++) {
    const int i = it.q0 + r / G, h = it.kvh * G + r % G;
    const T* src = static_cast<const T*>(a.qkv) + (qs + i) * a.qkv_stride + int64_t(h) * D;
    for (int d = 0; d < DV; d++) (V::load(src + d * W) * scale).store(q + r * D + d * W);
    for (int d = 0; d < DV; d++) V::zero().store(O + r * D + d * W);
    m[r] = -INFINITY;
    l[r] = 0.f;
    last_key[r] = ctx0 + i;
  }
  const int64_t end = ctx0 + it.q1;  // keys [0, end) are visible to some row
  for (int64_t j0 = 0; j0 < end; j0 += KC) {
    const int nk = int(std::min<int64_t>(KC, end - j0));
    for (int j = 0; j < nk; j++) {
      const int64_t pos = j0 + j;
      const int64_t slot = table[pos / a.bs] * a.bs + pos % a.bs;
      krow[j] = kc + slot * row_elems;
      vrow[j] = vc + slot * row_elems;
    }
    qk_chunk<T, DV>(q, nrows, krow, nk, S);
    for (int r = 0; r < nrows; r++) {
      float* s = S + r * KC;
      const int visible = int(std::min<int64_t>(nk, last_key[r] - j0 + 1));  // >= 1 in the first chunk
      for (int j = std::max(visible, 0); j < nk; j++) s[j] = -INFINITY;
      for (int j = nk; j < KC; j++) s[j] = -INFINITY;
      V mx = V::set1(m[r]);
      for (int j = 0; j < KC; j += W) mx = V::max(mx, V::load(s + j));
      const float m_new = mx.hmax();
      const float alpha = expf(m[r] - m_new);  // 0 on the first chunk (m = -inf)
      const V mn = V::set1(m_new);
      V psum = V::zero();
      for (int j = 0; j < KC; j += W) {
        V p = V::exp(V::load(s + j) - mn);
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
    pv_chunk<T, DV>(S, nrows, vrow, nk, O);
  }
  for (int r = 0; r < nrows; r++) {
    const int i = it.q0 + r / G, h = it.kvh * G + r % G;
    T* dst = static_cast<T*>(a.out) + (qs + i) * a.out_stride + int64_t(h) * D;
    const V inv = V::set1(1.f / l[r]);
    for (int d = 0; d < DV; d++) (V::load(O + r * D + d * W) * inv).store(dst + d * W);
  }
}

// Rotate (rotate-half layout) the q and k heads of token t in place and store its k, v in the paged cache.
template <typename T>
void rope_and_store(T* qkv, int64_t qkv_stride, int64_t t, int64_t pos, const float* cos_sin, int64_t slot,
                    T* k_cache, T* v_cache, int H, int KVH, int D) {
  T* row = qkv + t * qkv_stride;
  const int half = D / 2;
  if (cos_sin != nullptr) {
    const float* cs = cos_sin + pos * D;  // [cos(half), sin(half)]
    for (int h = 0; h < H + KVH; h++) {
      T* x = row + int64_t(h) * D;
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
  }
  const int64_t kv = int64_t(KVH) * D;
  memcpy(k_cache + slot * kv, row + int64_t(H) * D, sizeof(T) * kv);
  memcpy(v_cache + slot * kv, row + int64_t(H + KVH) * D, sizeof(T) * kv);
}

template <typename T, int DV>
int attention_impl(const AttnArgs& a, const float* cos_sin, int num_reqs, int num_threads) {
  // Token -> (request, position) for the rope / cache-write phase, and the work items.
  const int64_t T_total = a.query_start[num_reqs];
  const int G = a.H / a.KVH;
  const int tq = std::max(1, MAX_ROWS / G);
  int n_items = 0;
  for (int r = 0; r < num_reqs; r++) {
    const int n = int(a.query_start[r + 1] - a.query_start[r]);
    n_items += a.KVH * ((n + tq - 1) / tq);
  }
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
    for (int q0 = 0; q0 < n; q0 += tq) {
      const int q1 = std::min(n, q0 + tq);
      for (int h = 0; h < a.KVH; h++) items[k++] = Item{r, h, q0, q1, int64_t(q1 - q0) * (ctx0 + q1)};
    }
  }
  // Longest first: with dynamic scheduling the threads then finish close together.
  std::sort(items, items + n_items, [](const Item& x, const Item& y) { return x.cost > y.cost; });
  T* qkv = static_cast<T*>(const_cast<void*>(a.qkv));
  T* kc = static_cast<T*>(const_cast<void*>(a.k_cache));
  T* vc = static_cast<T*>(const_cast<void*>(a.v_cache));
  int64_t work = 0;
  for (int i = 0; i < n_items; i++) work += items[i].cost;
  const int threads = work * a.D < 32768 ? 1 : std::max(1, num_threads);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T_total; t++) {
      const int r = req_of_token[t];
      const int64_t n = a.query_start[r + 1] - a.query_start[r];
      const int64_t pos = a.seq_lens[r] - n + (t - a.query_start[r]);
      const int64_t slot = a.block_table[r * a.bt_stride + pos / a.bs] * a.bs + pos % a.bs;
      rope_and_store<T>(qkv, a.qkv_stride, t, pos, cos_sin, slot, kc, vc, a.H, a.KVH, a.D);
    }
    // the implicit barrier above: every new K/V row is in the cache before any item reads it
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n_items; i++) attend_item<T, DV>(a, items[i]);
  }
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
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; r++)
    add_rmsnorm_row<T>(static_cast<const T*>(x) + r * x_stride, static_cast<T*>(res) + r * n,
                       static_cast<const T*>(w), static_cast<T*>(out) + r * n, n, eps, add);
}

// SwiGLU on a fused gate_up projection: out[r, i] = silu(gate[r, i]) * up[r, i].
template <typename T>
void silu_mul_impl(const void* gu, void* out, int64_t rows, int64_t n, int num_threads) {
  const int threads = rows * n < (1 << 15) ? 1 : std::max(1, num_threads);
  const int64_t nv = n / W * W;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    const T* g = static_cast<const T*>(gu) + r * 2 * n;
    const T* u = g + n;
    T* o = static_cast<T*>(out) + r * n;
    const V one = V::set1(1.f);
    for (int64_t i = 0; i < nv; i += W) {
      V x = V::load(g + i);
      V s = x / (one + V::exp(V::zero() - x));
      (s * V::load(u + i)).store(o + i);
    }
    for (int64_t i = nv; i < n; i++) {
      const float x = to_f32(g[i]);
      from_f32(x / (1.f + expf(-x)) * to_f32(u[i]), o + i);
    }
  }
}

}  // namespace

extern "C" {

int cvk_abi_version() { return 1; }

int cvk_vector_width() { return W; }

// Rope (when cos_sin is not NULL) + KV-cache write + causal attention for every request of a step.
//   qkv [T, qkv_stride]: per token H query heads, then KVH key heads, then KVH value heads, D each; the q and
//     k heads are rotated in place. Request r owns tokens [query_start[r], query_start[r+1]) at positions
//     seq_lens[r] - n_r ... seq_lens[r] - 1, and their K/V go to the slots its block table gives.
//   k_cache, v_cache [num_blocks, bs, KVH, D]; block_table [num_reqs, bt_stride]; cos_sin [positions, D]
//     (cos in the first half of a row, sin in the second); out [T, out_stride] gets H * D per token.
// Returns 0, -1 when out of memory, -2 when this build does not support the head size.
int cvk_attention(int dtype, void* qkv, int64_t qkv_stride, void* k_cache, void* v_cache,
                  const int64_t* block_table, int64_t bt_stride, const int64_t* query_start,
                  const int64_t* seq_lens, int num_reqs, const float* cos_sin, void* out, int64_t out_stride, int H,
                  int KVH, int D, int bs, float scale, int num_threads) {
  if (num_reqs <= 0) return 0;
  if (D > MAX_D || H % KVH != 0 || H / KVH > MAX_ROWS) return -2;
  const AttnArgs a{qkv, qkv_stride, k_cache, v_cache, block_table, bt_stride, query_start, seq_lens,
                   out, out_stride, H, KVH, D, bs, scale};
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

// out [rows, n] <- silu(gate_up[:, :n]) * gate_up[:, n:].
int cvk_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t n, int num_threads) {
  if (dtype == 0) silu_mul_impl<float>(gate_up, out, rows, n, num_threads);
  else if (dtype == 1) silu_mul_impl<uint16_t>(gate_up, out, rows, n, num_threads);
  else return -3;
  return 0;
}

}  // extern "C"
