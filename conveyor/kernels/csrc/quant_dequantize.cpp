// Quantized weights (cvk.h's CvkQuantWeight) back to float: the whole weight (the float GEMM's operand above
// QUANT_INT_MAX_ROWS, conveyor/layers/quantized.py) or some rows (a quantized embedding's lookups).
#include <stdint.h>

#include <algorithm>

#include "bf16.h"
#include "kernels.h"
#include "qdot.h"
#include "quant_layout.h"
#include "team.h"

namespace cvk {
namespace {

using namespace qlayout;

// Column c's scale and offset in group g's block j, as float32 (cvk.h's scale formats; offset NULL: mid x scale).
inline void block_scale_offset(const CvkQuantWeight& w, int64_t g, int64_t j, int64_t c, float& sc, float& of) {
  const int64_t nb = blocks(w.KP), i = (g * nb + j) * QG + c;
  if (w.kind == CVK_W8A8) {  // one float32 scale per column, q stored as q + 128
    sc = static_cast<const float*>(w.scale)[g * QG + c];
    of = -128.f * sc;
    return;
  }
  if (w.scale_format == CVK_SCALE_KQUANT) {
    const uint16_t* super = group_super(w, g, nb) + (j / 8) * 2 * QG;
    sc = _cvtsh_ss(super[c]) * float(static_cast<const uint8_t*>(w.scale)[i]);
    of = -_cvtsh_ss(super[QG + c]) * float(static_cast<const uint8_t*>(w.offset)[i]);
    return;
  }
  auto at = [&](const void* base) {
    return w.scale_format == CVK_SCALE_F16 ? _cvtsh_ss(static_cast<const uint16_t*>(base)[i])
                                           : static_cast<const float*>(base)[i];
  };
  sc = at(w.scale);
  of = w.offset != nullptr ? at(w.offset) : sc * mid_offset(w.kind);
}

// Column c of a CVK_Q6 group's block j (blk, its 384 bytes), dequantized into vals (cvk.h's layout).
inline void dequantize_q6_block(const CvkQuantWeight& w, const uint8_t* blk, int64_t g, int64_t j, int c,
                                float* vals) {
  const int64_t nb = blocks(w.KP);
  const float super = _cvtsh_ss(static_cast<const uint16_t*>(w.super_scale)[(g * (nb / 8) + j / 8) * QG + c]);
  const int8_t* sub = static_cast<const int8_t*>(w.scale) + (g * nb + j) * 2 * QG;
  for (int t = 0; t < 8; t++)
    for (int b = 0; b < 4; b++) {
      const int low = (blk[(t / 2) * 64 + c * 4 + b] >> ((t % 2) * 4)) & 0x0F;
      const int high = (blk[256 + (t / 4) * 64 + c * 4 + b] >> (2 * (t % 4))) & 0x03;
      vals[t * 4 + b] = super * float(sub[(t / 4) * QG + c]) * float((low | high << 4) - kQ6Mid);
    }
}

// Rows `rows` (or 0 .. count - 1 when rows is NULL) of W, dequantized to T: row n is column n % 16 of group n / 16
// of the part of W (w, w.next, ...) that holds it.
template <typename T>
void dequantize_impl(const CvkQuantWeight& whole, const int64_t* rows, int64_t count, T* out, int64_t out_stride,
                     int num_threads) {
  // A step's embedding lookup (a few rows) alone: no team to fork and join (as the norms and argmax decide)
  const int threads = count * whole.K < (1 << 15) ? 1 : num_threads;
  on_team(threads, [&] {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; i++) {
      int64_t n = rows ? rows[i] : i;
      const CvkQuantWeight* part = &whole;
      while (n >= part->N) {
        n -= part->N;
        part = part->next;
      }
      const CvkQuantWeight& w = *part;
      const int64_t nb = blocks(w.KP), bb = block_bytes(w.kind);
      const int64_t g = n / QG, c = n % QG;
      const uint8_t* qs = static_cast<const uint8_t*>(w.qs) + g * nb * bb;
      T* dst = out + i * out_stride;
      for (int64_t j = 0; j < nb && j * QB < w.K; j++) {
        alignas(64) float vals[QB];
        const uint8_t* blk = qs + j * bb;
        const int lim = int(std::min<int64_t>(QB, w.K - j * QB));
        if (w.kind == CVK_Q6) {
          dequantize_q6_block(w, blk, g, j, int(c), vals);
          for (int t = 0; t < lim; t++) from_f32(vals[t], dst + j * QB + t);
          continue;
        }
        for (int t = 0; t < 8; t++)
          for (int b = 0; b < 4; b++) {
            const bool nibbles = w.kind == CVK_Q4 || w.kind == CVK_Q5;
            int v = nibbles ? (blk[(t / 2) * 64 + c * 4 + b] >> ((t % 2) * 4)) & 0x0F : blk[t * 64 + c * 4 + b];
            if (w.kind == CVK_Q5) v |= ((blk[256 + c * 4 + b] >> t) & 1) << 4;  // the fifth-bit plane (cvk.h)
            vals[t * 4 + b] = float(v);
          }
        float sc, of;
        block_scale_offset(w, g, j, c, sc, of);
        for (int t = 0; t < lim; t++) from_f32(vals[t] * sc + of, dst + j * QB + t);
      }
    }
  });
}

}  // namespace

int quant_dequantize(const CvkQuantWeight& w, const int64_t* rows, int64_t count, int dtype, void* out,
                     int64_t out_stride, int num_threads) {
  if (!valid(&w)) return CVK_ERR_BADARG;
  if (rows)
    for (int64_t i = 0; i < count; i++)
      if (rows[i] < 0 || rows[i] >= total_rows(w)) return CVK_ERR_BADARG;
  if (!rows && count > total_rows(w)) return CVK_ERR_BADARG;
  if (dtype == CVK_F32)
    dequantize_impl(w, rows, count, static_cast<float*>(out), out_stride, num_threads);
  else if (dtype == CVK_BF16)
    dequantize_impl(w, rows, count, static_cast<uint16_t*>(out), out_stride, num_threads);
  else
    return CVK_ERR_BADARG;
  return CVK_OK;
}

}  // namespace cvk
