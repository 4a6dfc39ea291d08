// The attention work plan of a step: the work items, longest first, the team size and how the new tokens'
// rope + cache write is done. It depends only on the step's requests and head layout, not on the layer, so it
// is built once per step (cvk_attention_plan, from NativeCpuAttention; or once per cvk_llama_layers call) and
// every layer's call reads it, as vLLM's CPU attention reuses its per-step scheduler metadata. (Before, every
// layer's call built it again, on every thread of the team.)
#pragma once

#include <stdint.h>

#include <algorithm>

#include "attention_common.h"

namespace cvk {

// The plan in one buffer: PlanHeader, then items[n_items], then req_of_token[T_total] (int32).
struct PlanHeader {
  int32_t magic;                   // kPlanMagic: a buffer that is not a plan fails the check
  int32_t num_reqs, H, KVH, D;     // what it was built for: checked against every call's arguments
  int32_t n_items, threads;
  int32_t item_ropes;              // every request decodes one token: each item ropes and stores its own K/V
  int64_t T_total;
};
constexpr int32_t kPlanMagic = 0x43564b50;  // "CVKP"

inline const Item* plan_items(const PlanHeader* p) { return reinterpret_cast<const Item*>(p + 1); }
inline const int32_t* plan_req_of_token(const PlanHeader* p) {
  return reinterpret_cast<const int32_t*>(plan_items(p) + p->n_items);
}

// One-query items (decodes) take several kv heads each, all of them when there are enough requests to keep
// every thread busy: a chunk of K/V rows is then read in order, once.
inline int plan_heads_per_item(const AttnArgs& a, int num_one) {
  const int G = a.H / a.KVH;
  const int want_items = 4 * std::max(1, a.num_threads);
  const int splits = num_one >= want_items ? 1
                     : std::min(a.KVH, (want_items + std::max(num_one, 1) - 1) / std::max(num_one, 1));
  return std::max(1, std::min((a.KVH + splits - 1) / splits, MAX_QROWS / G));
}

inline int plan_num_one(const AttnArgs& a) {
  int num_one = 0;
  for (int r = 0; r < a.num_reqs; r++) num_one += a.query_start[r + 1] - a.query_start[r] == 1;
  return num_one;
}

inline int plan_n_items(const AttnArgs& a, int heads_per_item) {
  const int tq = std::max(1, MAX_ROWS / (a.H / a.KVH));
  int n_items = 0;
  for (int r = 0; r < a.num_reqs; r++) {
    const int n = int(a.query_start[r + 1] - a.query_start[r]);
    n_items += n == 1 ? (a.KVH + heads_per_item - 1) / heads_per_item : a.KVH * ((n + tq - 1) / tq);
  }
  return n_items;
}

// The bytes plan_build needs for these arguments (H, KVH, D, num_reqs, query_start, seq_lens, num_threads).
inline int64_t plan_bytes(const AttnArgs& a) {
  const int n_items = plan_n_items(a, plan_heads_per_item(a, plan_num_one(a)));
  return int64_t(sizeof(PlanHeader)) + int64_t(sizeof(Item)) * n_items +
         int64_t(sizeof(int32_t)) * a.query_start[a.num_reqs];
}

// Builds the plan into buf (plan_bytes(a) bytes, 8-byte aligned).
inline void plan_build(const AttnArgs& a, void* buf) {
  const int G = a.H / a.KVH;
  const int tq = std::max(1, MAX_ROWS / G);
  const int num_one = plan_num_one(a);
  const int heads_per_item = plan_heads_per_item(a, num_one);
  PlanHeader* p = static_cast<PlanHeader*>(buf);
  *p = PlanHeader{kPlanMagic, a.num_reqs, a.H, a.KVH, a.D, plan_n_items(a, heads_per_item), 1, 0,
                  a.query_start[a.num_reqs]};
  Item* items = const_cast<Item*>(plan_items(p));
  int32_t* req_of_token = const_cast<int32_t*>(plan_req_of_token(p));
  int k = 0;
  for (int r = 0; r < a.num_reqs; r++) {
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
  std::sort(items, items + p->n_items, [](const Item& x, const Item& y) { return x.cost > y.cost; });
  int64_t work = 0;
  for (int i = 0; i < p->n_items; i++) work += items[i].cost;
  p->threads = work * a.D < 32768 ? 1 : std::max(1, a.num_threads);
  // When every request decodes one token, an item's new K/V row and q heads are its own (items split a request
  // by kv heads only): the item ropes and stores them itself, right before it reads them, and the step needs
  // no separate pass and barrier for it.
  p->item_ropes = num_one == a.num_reqs;
}

// Whether `plan` was built for these arguments.
inline bool plan_matches(const PlanHeader* p, const AttnArgs& a) {
  return p->magic == kPlanMagic && p->num_reqs == a.num_reqs && p->H == a.H && p->KVH == a.KVH && p->D == a.D &&
         p->T_total == a.query_start[a.num_reqs];
}

}  // namespace cvk
