// Attention mass per key for KV eviction by score (CvkAttnArgs.key_mass): what each scored query row's softmax
// puts on each key, summed over the row's query heads of a kv head, added into the request's buffer.
//  - one query (decodes, the step h2o scores every time): captured inside the decode loop. Its online softmax
//    leaves, per chunk of keys, p_j = exp(s_j - m_c) for the row's running maximum m_c at that chunk; the final
//    probability is p_j * exp(m_c - m) / l once the last chunk gave m and l. So the loop keeps each chunk's p and
//    m_c (MassCapture) and the item finishes with one multiply-add per (row, key): no second pass over the keys,
//    which, K being read from memory, would cost as much as the scores themselves.
//  - a tile of queries (prompt chunks: at most their last few rows are scored, once per chunk): an exact softmax
//    of those rows after the step's attention (mass_rows), one task per (request, kv head), reading the rotated q
//    and the cache; it leaves the tile loops (scores in vector lanes, AMX tiles) untouched.
// Both add to disjoint places: a decode item owns its kv heads, a post-pass task its (request, kv head).
#pragma once

#include <vector>

#include "attention_common.h"

namespace cvk {

// Whether request r's rows are scored in this call, and its buffer ([KVH, mass_stride] floats).
inline float* mass_of(const AttnArgs& a, int r) {
  if (a.key_mass == nullptr || a.score_rows[r] <= 0) return nullptr;
  return a.key_mass + a.mass_offset[r];
}

// A decode item's probabilities per chunk, kept until its softmax is final (see the top of this file).
struct MassCapture {
  float* p = nullptr;   // [rows][chunks][KC]
  float* mc = nullptr;  // [rows][chunks]
  int chunks = 0;

  // Room for `rows` rows over keys [0, end), from this thread's scratch (grown, never shrunk).
  void begin(int rows, int64_t end) {
    thread_local std::vector<float> scratch;
    chunks = int((end + KC - 1) / KC);
    const size_t need = size_t(rows) * chunks * (KC + 1);
    if (scratch.size() < need) scratch.resize(need);
    p = scratch.data();
    mc = p + size_t(rows) * chunks * KC;
  }
  // Row r's probabilities of chunk c against its running maximum m_c (KC values; padding keys hold 0).
  inline void keep(int r, int c, const float* probs, float m_c) {
    memcpy(p + (size_t(r) * chunks + c) * KC, probs, sizeof(float) * KC);
    mc[size_t(r) * chunks + c] = m_c;
  }
  // mass[h - kvh][key] += the final probabilities of the G rows of each kv head h of the item.
  void finish(const AttnArgs& a, int kvh, int kvh_end, int G, const float* m, const float* l, float* mass) const {
    static_assert(KC % W == 0, "a chunk is whole vectors");
    for (int h = kvh; h < kvh_end; h++) {
      float* dst = mass + int64_t(h) * a.mass_stride;
      for (int r = (h - kvh) * G; r < (h - kvh + 1) * G; r++) {
        const float inv_l = 1.f / l[r];
        for (int c = 0; c < chunks; c++) {
          const V f = V::set1(expf(mc[size_t(r) * chunks + c] - m[r]) * inv_l);
          const float* src = p + (size_t(r) * chunks + c) * KC;
          float* d = dst + c * KC;
          for (int j = 0; j < KC; j += W) V::fma(V::load(src + j), f, V::load(d + j)).store(d + j);
        }
      }
    }
  }
};

// Tile requests: the exact softmax of request r's last score_rows[r] query rows, heads of kv head h, over the
// keys each sees, added into its mass. Two passes over the row's scores (scores, then exp and sum), in float32,
// vector-wide: the scores W keys at a time with one transpose-add tree (as the decode loop), the softmax and
// the accumulation over whole vectors with the row's unseen keys at -inf (the buffer is padded to whole chunks).
template <typename T, int DV, typename C>
void mass_rows(const AttnArgs& a, int r, int h) {
  const int dv = head_dv<DV>(a), D = dv * W;
  constexpr int KP = (KC + W - 1) / W * W;
  const int G = a.H / a.KVH;
  const int64_t qs = a.query_start[r], n = a.query_start[r + 1] - qs;
  const int64_t ctx0 = a.seq_lens[r] - n;
  const int rows = int(std::min<int64_t>(a.score_rows[r], n));
  const int64_t first = n - rows;                      // the first scored query
  const int64_t end = ctx0 + n;                        // keys any scored row sees
  const int64_t span = (end + KC - 1) / KC * KC;       // whole chunks: mass_stride covers them (mass_fits)
  const int64_t* table = a.block_table + int64_t(r) * a.bt_stride;
  float* dst = a.key_mass + a.mass_offset[r] + int64_t(h) * a.mass_stride;
  thread_local std::vector<float> scratch;
  const size_t need = size_t(rows) * G * (D + span);
  if (scratch.size() < need) scratch.resize(need);
  float* q = scratch.data();             // [rows * G][D], scaled
  float* S = q + size_t(rows) * G * D;   // [rows * G][span]
  for (int i = 0; i < rows; i++)
    for (int g = 0; g < G; g++) {
      const T* src = static_cast<const T*>(a.q) + (qs + first + i) * a.q_stride + int64_t(h * G + g) * D;
      load_query_row<T, C>(src, dv, a.scale, q + (size_t(i) * G + g) * D);
    }
  alignas(64) float kbuf[sizeof(C) != 4 ? KP * max_dv<DV>() * W : 1];
  const float* krow[KP];
  for (int64_t j0 = 0; j0 < end; j0 += KC) {
    const int nk = int(std::min<int64_t>(KC, end - j0));
    chunk_rows<C, DV>(a, table, static_cast<const C*>(a.k_cache), h, j0, nk, KP, krow, kbuf);
    for (int x = 0; x < rows * G; x++) {
      V qx[max_dv<DV>()];
      for (int d = 0; d < dv; d++) qx[d] = V::load(q + size_t(x) * D + d * W);
      float* s = S + size_t(x) * span + j0;
      for (int jg = 0; jg < KC; jg += W) {
        V acc[W];
        for (int u = 0; u < W; u++) {
          acc[u] = V::zero();
          for (int d = 0; d < dv; d++) acc[u] = V::fma(qx[d], V::load(krow[jg + u] + d * W), acc[u]);
        }
        V::hsum_lanes(acc).store(s + jg);
      }
    }
  }
  for (int x = 0; x < rows * G; x++) {
    const int64_t seen = ctx0 + first + x / G + 1;  // causal: keys [0, its own slot]
    float* s = S + size_t(x) * span;
    for (int64_t j = seen; j < span; j++) s[j] = -INFINITY;
    V mx = V::set1(-INFINITY);
    for (int64_t j = 0; j < span; j += W) mx = V::max(mx, V::load(s + j));
    const V m = V::set1(mx.hmax());
    V sum = V::zero();
    for (int64_t j = 0; j < span; j += W) {
      const V p = V::exp(V::load(s + j) - m);
      p.store(s + j);
      sum = sum + p;
    }
    const V inv = V::set1(1.f / sum.sum());
    for (int64_t j = 0; j < span; j += W) V::fma(V::load(s + j), inv, V::load(dst + j)).store(dst + j);
  }
}

}  // namespace cvk
