// Attention for a whole step: rope + KV-cache write + causal attention of every request, one call per layer.
// The loops are in attention_decode.h (one query per item) and attention_prefill.h (a tile of queries); this
// file runs the step's work plan (attention_plan.h) on the team.
#include <stdlib.h>

#include <algorithm>

#include "attention_decode.h"
#include "attention_plan.h"
#include "attention_prefill.h"
#include "kernels.h"
#include "team.h"

namespace cvk {
namespace {

template <typename T, int DV, typename C>
inline void attend_item(const AttnArgs& a, const Item& it) {
  if (it.q1 - it.q0 == 1) attend_one_query<T, DV, C>(a, it);
  else attend_tile<T, DV, C>(a, it);
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

// Token t of request r at KV slot `pos`: rotate its q and k heads in place (when cos_sin is given) by the angles
// of its position (the slot, plus the request's rope_offset when KV eviction shifted its slots), store its k and
// v in the cache (cache elements C: T, or int8 rows quantized here); for kv heads [h0, h1) and their query heads
// (default: all).
template <typename T, typename C>
void rope_and_store(const AttnArgs& a, int r, int64_t t, int64_t pos, const float* cos_sin, int h0 = 0,
                    int h1 = -1) {
  const int64_t* table = a.block_table + r * a.bt_stride;
  const int D = a.D, G = a.H / a.KVH;
  if (h1 < 0) h1 = a.KVH;
  T* q = static_cast<T*>(a.q) + t * a.q_stride;
  T* k = static_cast<T*>(a.k) + t * a.k_stride;
  const T* v = static_cast<const T*>(a.v) + t * a.v_stride;
  if (cos_sin != nullptr) {
    const int64_t position = pos + (a.rope_offset != nullptr ? a.rope_offset[r] : 0);
    const float* cs = cos_sin + position * D;  // [cos(half), sin(half)]
    for (int h = h0 * G; h < h1 * G; h++) rope_head(q + int64_t(h) * D, cs, D);
    for (int h = h0; h < h1; h++) rope_head(k + int64_t(h) * D, cs, D);
  }
  C* kc = static_cast<C*>(a.k_cache);
  C* vc = static_cast<C*>(a.v_cache);
  for (int h = h0; h < h1; h++) {
    const int64_t off = kv_offset(a, table, pos, h);
    store_kv_row(k + int64_t(h) * D, D / W, kc + off);
    store_kv_row(v + int64_t(h) * D, D / W, vc + off);
  }
}

template <typename T, int DV, typename C>
void attention_impl(const AttnArgs& a, const PlanHeader* plan) {
  const Item* items = plan_items(plan);
  const int32_t* req_of_token = plan_req_of_token(plan);
  const int n_items = plan->n_items;
  const int64_t T_total = plan->T_total;
  const bool item_ropes = plan->item_ropes != 0;
  bool scores_tiles = false;  // some request of more than one new token is scored (attention_mass.h)
  for (int r = 0; r < a.num_reqs && a.key_mass != nullptr; r++)
    scores_tiles = scores_tiles || (mass_of(a, r) != nullptr && a.query_start[r + 1] - a.query_start[r] > 1);
  on_team(plan->threads, [&] {
    if (!item_ropes) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T_total; t++) {
        const int r = req_of_token[t];
        const int64_t n = a.query_start[r + 1] - a.query_start[r];
        const int64_t pos = a.seq_lens[r] - n + (t - a.query_start[r]);
        rope_and_store<T, C>(a, r, t, pos, a.cos_sin);
      }
      // the implicit barrier above: every new K/V row is in the cache before any item reads it
    }
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n_items; i++) {
      const Item& it = items[i];
      if (item_ropes)
        rope_and_store<T, C>(a, it.req, a.query_start[it.req], a.seq_lens[it.req] - 1, a.cos_sin, it.kvh,
                             it.kvh_end);
      attend_item<T, DV, C>(a, it);
    }
    // scored prompt chunks: their rows' exact softmax, once every item is done (the barrier above)
    if (scores_tiles) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t x = 0; x < int64_t(a.num_reqs) * a.KVH; x++) {
        const int r = int(x / a.KVH);
        if (mass_of(a, r) != nullptr && a.query_start[r + 1] - a.query_start[r] > 1)
          mass_rows<T, DV, C>(a, r, int(x % a.KVH));
      }
    }
  });
}

template <typename T, typename C>
int attention_dispatch(const AttnArgs& a, const PlanHeader* plan) {
  // The models' common head sizes compiled in (each variant costs build time); every other multiple of W up to
  // MAX_D takes the generic path (DV = 0: attention_common.h).
  if (a.D == 64) return attention_impl<T, 64 / W, C>(a, plan), CVK_OK;
  if (a.D == 128) return attention_impl<T, 128 / W, C>(a, plan), CVK_OK;
  return attention_impl<T, 0, C>(a, plan), CVK_OK;
}

// The cache's elements: the step's dtype, bfloat16 under a float32 step, or int8 rows with their scales (cvk.h's
// kv_dtype; attention() refuses bfloat16 under a bfloat16 step, which is CVK_KV_SAME).
template <typename T>
int attention_dispatch(const AttnArgs& a, const PlanHeader* plan) {
  if (a.kv_dtype == CVK_KV_INT8) return attention_dispatch<T, int8_t>(a, plan);
  if constexpr (sizeof(T) == 4)
    if (a.kv_dtype == CVK_KV_BF16) return attention_dispatch<T, uint16_t>(a, plan);
  return attention_dispatch<T, T>(a, plan);
}

// The key mass's buffer must hold each scored request's keys, rounded up to the decode loop's chunks.
bool mass_fits(const AttnArgs& a) {
  if (a.key_mass == nullptr) return true;
  if (a.score_rows == nullptr || a.mass_offset == nullptr) return false;
  for (int r = 0; r < a.num_reqs; r++)
    if (a.score_rows[r] > 0 && (a.mass_offset[r] < 0 || a.mass_stride < (a.seq_lens[r] + KC - 1) / KC * KC))
      return false;
  return true;
}

}  // namespace

bool attention_supports(int H, int KVH, int D) {
  return D > 0 && D % W == 0 && D <= MAX_D && KVH > 0 && H % KVH == 0 && H / KVH <= MAX_G && H / KVH <= MAX_ROWS;
}

int64_t attention_plan_bytes(const AttnArgs& a) {
  if (a.num_reqs <= 0 || !attention_supports(a.H, a.KVH, a.D)) return 0;
  return plan_bytes(a);
}

int attention_plan(const AttnArgs& a, void* buf, int64_t bytes) {
  if (a.num_reqs <= 0) return CVK_OK;
  if (!attention_supports(a.H, a.KVH, a.D)) return CVK_ERR_UNSUPPORTED;
  if (buf == nullptr || reinterpret_cast<uintptr_t>(buf) % 8 != 0 || bytes < plan_bytes(a)) return CVK_ERR_BADARG;
  plan_build(a, buf);
  return CVK_OK;
}

// Without a plan (a.plan == NULL) the call builds its own; inside a team (the layer stack) every thread then
// builds the same one for itself (a few microseconds, nothing to share).
int attention(const AttnArgs& a) {
  if (a.num_reqs <= 0) return CVK_OK;
  if (a.dtype != CVK_F32 && a.dtype != CVK_BF16) return CVK_ERR_BADARG;
  if (a.kv_dtype != CVK_KV_SAME && a.kv_dtype != CVK_KV_INT8 && !(a.kv_dtype == CVK_KV_BF16 && a.dtype == CVK_F32))
    return CVK_ERR_BADARG;
  if (!attention_supports(a.H, a.KVH, a.D)) return CVK_ERR_UNSUPPORTED;
  if (!mass_fits(a)) return CVK_ERR_BADARG;
  if (a.window < 0 || (a.window > 0 && (a.key_mass != nullptr || a.rope_offset != nullptr))) return CVK_ERR_BADARG;
  const PlanHeader* plan = static_cast<const PlanHeader*>(a.plan);
  void* own = nullptr;
  if (plan == nullptr) {
    own = malloc(size_t(plan_bytes(a)));
    if (own == nullptr) return CVK_ERR_NOMEM;
    plan_build(a, own);
    plan = static_cast<const PlanHeader*>(own);
  } else if (!plan_matches(plan, a)) {
    return CVK_ERR_BADARG;
  }
  const int rc = a.dtype == CVK_F32 ? attention_dispatch<float>(a, plan) : attention_dispatch<uint16_t>(a, plan);
  free(own);
  return rc;
}

}  // namespace cvk
