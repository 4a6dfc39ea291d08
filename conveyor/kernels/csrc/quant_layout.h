// The packed layout of a quantized weight (cvk.h's CvkQuantWeight) as gemm_quant.cpp's GEMM and
// quant_dequantize.cpp's dequantization both address it: block and group sizes, bytes a block, where a group's
// scales lie, and the checks a descriptor must pass.
#pragma once

#include <stdint.h>

#include "cvk.h"
#include "qdot.h"

namespace cvk {
namespace qlayout {

constexpr int QB = 32;  // values per block
constexpr int QG = 16;  // columns per group

inline int64_t blocks(int64_t KP) { return KP / QB; }
inline int64_t block_bytes(int kind) {
  return kind == CVK_Q4 ? kBlockBytes<4> : kind == CVK_Q5 ? kBlockBytes<5> : kind == CVK_Q6 ? kQ6BlockBytes : 512;
}

// Group g's scales (or offsets) in the weight's storage type S (float, or uint16_t halves: cvk.h); NULL for
// offsets the weight does not store (qdot.h's kMidOffset).
template <typename S>
inline const S* group_scales(const void* base, int64_t g, int64_t nb) {
  return base == nullptr ? nullptr : static_cast<const S*>(base) + g * nb * QG;
}

// Group g's K-quant super-scales (CVK_SCALE_KQUANT: [KP/256][2][16] halves a group), or NULL.
inline const uint16_t* group_super(const CvkQuantWeight& w, int64_t g, int64_t nb) {
  return w.super_scale == nullptr ? nullptr : static_cast<const uint16_t*>(w.super_scale) + g * (nb / 8) * 2 * QG;
}

// One part of a chain well formed (its kind, scale format, offsets and super-scales as cvk.h pairs them).
inline bool valid_part(const CvkQuantWeight* w) {
  if (w->kind == CVK_W8A8)  // whole-K int32 sums: exact while K x 255 x 127 < 2^31
    return w->scale_format == CVK_SCALE_F32 && w->offset == nullptr && w->super_scale == nullptr && w->KP < 65536;
  if (w->kind == CVK_Q6)
    return w->scale_format == CVK_SCALE_F32 && w->offset == nullptr && w->super_scale != nullptr && w->KP % 256 == 0;
  if (w->scale_format == CVK_SCALE_KQUANT)
    return (w->kind == CVK_Q4 || w->kind == CVK_Q5 || w->kind == CVK_Q8) && w->offset != nullptr &&
           w->super_scale != nullptr && w->KP % 256 == 0;
  return (w->kind == CVK_Q4 || w->kind == CVK_Q5 || w->kind == CVK_Q8) &&
         (w->scale_format == CVK_SCALE_F32 || w->scale_format == CVK_SCALE_F16);
}

// Every part well formed, of one K and KP (the activations are quantized once for all of them); at most 16 parts.
inline bool valid(const CvkQuantWeight* w) {
  if (w == nullptr) return false;
  int parts = 0;
  for (const CvkQuantWeight* p = w; p != nullptr; p = p->next) {
    if (++parts > 16 || !valid_part(p) || p->K != w->K || p->KP != w->KP) return false;
    if ((p->kind == CVK_W8A8) != (w->kind == CVK_W8A8)) return false;  // one activation quantization per call
    if (p->KP % QB != 0 || p->K <= 0 || p->K > p->KP || p->N <= 0 || p->qs == nullptr || p->scale == nullptr)
      return false;
  }
  return true;
}

// Rows of every part of the chain.
inline int64_t total_rows(const CvkQuantWeight& w) {
  int64_t n = 0;
  for (const CvkQuantWeight* p = &w; p != nullptr; p = p->next) n += p->N;
  return n;
}

}  // namespace qlayout
}  // namespace cvk
