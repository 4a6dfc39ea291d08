// Attention for a whole step: rope + KV-cache write + causal attention of every request, one call per layer.
// The loops are in attention_decode.h (one query per item) and attention_prefill.h (a tile of queries); this
// file builds the work items and runs them on the team.
#include <stdlib.h>

#include <algorithm>

#include "attention_decode.h"
#include "attention_prefill.h"
#include "kernels.h"
#include "team.h"

namespace cvk {
namespace {

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

}  // namespace

bool attention_supports(int H, int KVH, int D) {
  return D <= MAX_D && KVH > 0 && H % KVH == 0 && H / KVH <= MAX_G && H / KVH <= MAX_ROWS;
}

int attention(int dtype, const AttnArgs& a, const float* cos_sin, int num_reqs, int num_threads) {
  if (dtype == 0) return attention_dispatch<float>(a, cos_sin, num_reqs, num_threads);
  if (dtype == 1) return attention_dispatch<uint16_t>(a, cos_sin, num_reqs, num_threads);
  return -3;
}

}  // namespace cvk
