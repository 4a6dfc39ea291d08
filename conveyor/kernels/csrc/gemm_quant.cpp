// The GEMM on quantized weights (cvk_quant_gemm: CvkQuantWeight in cvk.h) and their dequantization.
//
// How: the activations are quantized per block of 32 to 15-bit integers n held as two int8 digits (qdot.h; as
// llama.cpp's q8_0, at twice the digits, plus d * sum(n) per block for the weights' offsets), then every
// (row, column) is a sum over blocks of
//   scale_w * d_x * <q_w, n_x>  +  offset_w * d_x * sum(n_x)
// Columns go 16 at a time, so a block's integer dot products for 16 columns are 2 x 8 VPDPBUSDs (qdot_*.h)
// and its scaling one float FMA for all 16: the float work per block is shared by 16 columns instead of done per
// column. At decode sizes the step is bound by the weight stream, 4-6x smaller than float32's. Which row
// counts take this path and which dequantize to float and take the float GEMM is decided in
// conveyor/layers/quantized.py (QUANT_INT_MAX_ROWS) from benchmarks/gemm_quant.py.
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "bf16.h"
#include "kernels.h"
#include "qdot.h"
#include "qdot_amx.h"
#include "team.h"
#include "vec.h"

namespace cvk {
namespace {

constexpr int QB = 32;  // values per block
constexpr int QG = 16;  // columns per group

inline int64_t blocks(int64_t KP) { return KP / QB; }
// Bytes of one tile of kAmxRows activation rows packed for the AMX loop: digits (512) and units (16 floats) per block.
inline int64_t amx_tile_bytes(int64_t KP) { return blocks(KP) * (512 + 16 * int64_t(sizeof(float))); }
inline int64_t block_bytes(int kind) {
  return kind == CVK_Q4 ? kBlockBytes<4> : kind == CVK_Q5 ? kBlockBytes<5> : kind == CVK_Q6 ? kQ6BlockBytes : 512;
}
// Whether a step of M rows runs on the AMX-INT8 tiles for a weight of this kind (where they were switched on:
// cvk_set_amx_qdot).
inline bool takes_amx(int64_t M, int kind) {
  // Q6_K's sub-blocks of 16, the 5-bit plane, W8A8: the VNNI loops only
  if (kind == CVK_Q6 || kind == CVK_Q5 || kind == CVK_W8A8) return false;
  const int64_t min_rows = kind == CVK_Q4 ? g_amx_qdot_min_rows_q4 : g_amx_qdot_min_rows_q8;
  return kAmx && min_rows > 0 && M >= min_rows;
}
// ... and for this weight: K-quant sub-scales (CVK_SCALE_KQUANT) take the VNNI loop only (the AMX epilogue reads
// float or half scales).
inline bool takes_amx(int64_t M, const CvkQuantWeight& w) {
  return w.scale_format != CVK_SCALE_KQUANT && takes_amx(M, w.kind);
}

// One row of x (dtype) -> its QRow in `out` (quant_row_bytes bytes), blocks past K zero.
template <typename T>
void quantize_row(const T* x, int64_t K, int64_t KP, char* out) {
  const int64_t nb = blocks(KP);
  int8_t* hi = reinterpret_cast<int8_t*>(out);
  int8_t* lo = hi + KP;
  float* d = reinterpret_cast<float*>(out + 2 * KP);
  float* s = d + nb;
  int32_t* hs = reinterpret_cast<int32_t*>(s + nb);
  alignas(64) float tmp[QB];
  for (int64_t j = 0; j < nb; j++) {
    const int64_t k0 = j * QB, n = std::min<int64_t>(QB, K - k0);
    const float* src = tmp;
    if constexpr (sizeof(T) == 4) {
      if (n == QB) src = reinterpret_cast<const float*>(x) + k0;
    }
    if (src == tmp) {
      for (int i = 0; i < QB; i++) tmp[i] = i < n ? to_f32(x[k0 + i]) : 0.f;
    }
    qdot::quantize_block(src, hi + k0, lo + k0, d + j, s + j, hs + 2 * j);
  }
}

inline QRow row_view(const char* base, int64_t KP) {
  const int8_t* hi = reinterpret_cast<const int8_t*>(base);
  const float* d = reinterpret_cast<const float*>(base + 2 * KP);
  return QRow{hi, hi + KP, d, d + blocks(KP), reinterpret_cast<const int32_t*>(d + 2 * blocks(KP))};
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

// expanded: NULL, or group g's 5-bit blocks already as 8-bit ones (expand_group), which the loop then reads.
template <int R, typename S>
inline void group_rows_as(const CvkQuantWeight& w, int64_t g, const QRow* xr, float* out, bool prefetch,
                          const uint8_t* expanded) {
  const int64_t nb = blocks(w.KP);
  const uint8_t* qs = static_cast<const uint8_t*>(w.qs) + g * nb * block_bytes(w.kind);
  const S* scale = group_scales<S>(w.scale, g, nb);
  const S* offset = group_scales<S>(w.offset, g, nb);
  const uint16_t* super = group_super(w, g, nb);
  if (w.kind == CVK_Q4)
    qdot::group_dot<R, 4>(qs, scale, offset, super, xr, nb, out, prefetch);
  else if (w.kind == CVK_Q5 && expanded != nullptr)
    qdot::group_dot<R, 5, S, true>(expanded, scale, offset, super, xr, nb, out, false);
  else if (w.kind == CVK_Q5)
    qdot::group_dot<R, 5>(qs, scale, offset, super, xr, nb, out, prefetch);
  else
    qdot::group_dot<R, 8>(qs, scale, offset, super, xr, nb, out, prefetch);
}

// A CVK_Q5 weight's group g as 8-bit blocks into out (nb x 512 bytes), streamed and prefetched as group_dot does.
inline void expand_group(const CvkQuantWeight& w, int64_t g, uint8_t* out) {
  const int64_t nb = blocks(w.KP);
  const uint8_t* qs = static_cast<const uint8_t*>(w.qs) + g * nb * block_bytes(w.kind);
  if (w.scale_format == CVK_SCALE_F32)
    qdot::expand_q5_group(qs, group_scales<float>(w.scale, g, nb), group_scales<float>(w.offset, g, nb), nb, out);
  else  // halves, or K-quant bytes (prefetched as halves: the same lines or the next)
    qdot::expand_q5_group(qs, group_scales<uint16_t>(w.scale, g, nb), group_scales<uint16_t>(w.offset, g, nb), nb,
                          out);
}

template <int R>
inline void group_rows(const CvkQuantWeight& w, int64_t g, const QRow* xr, float* out, bool prefetch,
                       const uint8_t* expanded) {
  if (w.kind == CVK_Q6) {
    const int64_t nb = blocks(w.KP);
    qdot::group_dot_q6<R>(static_cast<const uint8_t*>(w.qs) + g * nb * kQ6BlockBytes,
                          static_cast<const int8_t*>(w.scale) + g * nb * 2 * QG,
                          static_cast<const uint16_t*>(w.super_scale) + g * (nb / 8) * QG, xr, nb, out, prefetch);
    return;
  }
  if (w.scale_format == CVK_SCALE_F16)
    group_rows_as<R, uint16_t>(w, g, xr, out, prefetch, expanded);
  else if (w.scale_format == CVK_SCALE_KQUANT)
    group_rows_as<R, uint8_t>(w, g, xr, out, prefetch, expanded);
  else
    group_rows_as<R, float>(w, g, xr, out, prefetch, expanded);
}

template <int R>
inline void group_rows_upto(int r, const CvkQuantWeight& w, int64_t g, const QRow* xr, float* out, bool prefetch,
                            const uint8_t* expanded) {
  if constexpr (R > 1) {
    if (r < R) return group_rows_upto<R - 1>(r, w, g, xr, out, prefetch, expanded);
  }
  group_rows<R>(w, g, xr, out, prefetch, expanded);
}

// Adds the bias to R x 16 float sums (acc rows acc_stride apart) and stores the first nc columns of r rows at
// y + m0 rows, column n0.
template <typename T>
inline void store_group(const float* acc, int64_t acc_stride, int r, int nc, const T* bias, T* y, int64_t y_stride,
                        int64_t m0, int64_t n0) {
  for (int i = 0; i < r; i++) {
    T* out = y + (m0 + i) * y_stride + n0;
    for (int c = 0; c < nc; c++) from_f32(acc[i * acc_stride + c] + (bias ? to_f32(bias[n0 + c]) : 0.f), out + c);
  }
}

// Tiles of rows from which a 5-bit weight's groups are expanded to 8-bit blocks once (vector_groups): below, moving
// the fifth bits in every tile costs less than the expansion pass (benchmarks/gemm_quant.py --format Q5_0
// --against-q8; docs/kernels.md).
constexpr int64_t kQ5ExpandTiles = 8;

// The VNNI / AVX2 loop: each thread takes whole groups of 16 columns, kRows activation rows at a time. A 5-bit
// weight in a step of kQ5ExpandTiles tiles of rows or more has each group's fifth bits moved once, into 8-bit
// blocks in the thread's buffer that every tile reads from cache.
template <typename T>
void vector_groups(const CvkQuantGemmArgs& a, const char* scratch, int64_t rb) {
  const CvkQuantWeight& w = *a.w;
  const int64_t M = a.M, N = w.N, KP = w.KP;
  constexpr int R = qdot::kRows;
  const int64_t groups = (N + QG - 1) / QG;
  const bool expand = w.kind == CVK_Q5 && M >= kQ5ExpandTiles * R;
  // per thread, kept across calls (as amx_groups' buffer)
  thread_local std::vector<uint8_t, AlignedAlloc<uint8_t>> expanded;
  if (expand && expanded.size() < size_t(blocks(KP) * 512)) expanded.resize(blocks(KP) * 512);
#pragma omp for schedule(static)
  for (int64_t g = 0; g < groups; g++) {
    const int nc = int(std::min<int64_t>(QG, N - g * QG));
    if (expand) expand_group(w, g, expanded.data());
    for (int64_t m0 = 0; m0 < M; m0 += R) {
      const int r = int(std::min<int64_t>(R, M - m0));
      QRow xr[R];
      for (int i = 0; i < r; i++) xr[i] = row_view(scratch + (m0 + i) * rb, KP);
      alignas(64) float acc[R * QG];
      group_rows_upto<R>(r, w, g, xr, acc, /*prefetch=*/m0 == 0, expand ? expanded.data() : nullptr);
      store_group(acc, QG, r, nc, static_cast<const T*>(a.bias), static_cast<T*>(a.y), a.y_stride, m0, g * QG);
    }
  }
}

// The AMX-INT8 loop: the activations packed into A tiles (qdot::pack_activations), then each thread takes whole
// groups of 16 columns (4-bit weights unpacked once per group into the thread's buffer, so every tile pass reads
// them from cache), kAmxRows activation rows at a time. `packed`: digits (512 bytes) and units (16 floats) per
// block of each tile of rows (amx_tile_bytes a tile).
template <typename T>
void amx_groups(const CvkQuantGemmArgs& a, const char* scratch, int64_t rb, char* packed) {
  const CvkQuantWeight& w = *a.w;
  const int64_t M = a.M, N = w.N, KP = w.KP, nb = blocks(KP), bb = block_bytes(w.kind);
  const int64_t groups = (N + QG - 1) / QG, tiles = (M + qdot::kAmxRows - 1) / qdot::kAmxRows;
  const int64_t tile_bytes = amx_tile_bytes(KP);
  const bool q4 = w.kind == CVK_Q4;
  const float mid = mid_offset(w.kind);
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tiles; t++) {
    char* p = packed + t * tile_bytes;
    qdot::pack_activations(scratch + t * qdot::kAmxRows * rb, rb, KP,
                           int(std::min<int64_t>(qdot::kAmxRows, M - t * qdot::kAmxRows)), reinterpret_cast<int8_t*>(p),
                           reinterpret_cast<float*>(p + nb * 512));
  }
  // per thread, kept across calls (a large K would otherwise map and fault in fresh pages every call)
  thread_local std::vector<uint8_t, AlignedAlloc<uint8_t>> unpacked;
  if (q4 && unpacked.size() < size_t(nb * 512)) unpacked.resize(nb * 512);
  bool configured = false;
#pragma omp for schedule(static)
  for (int64_t g = 0; g < groups; g++) {
    if (!configured) {
      qdot::amx_configure_qdot();
      configured = true;
    }
    const uint8_t* wq = static_cast<const uint8_t*>(w.qs) + g * nb * bb;
    if (q4) {
      if (w.scale_format == CVK_SCALE_F16)
        qdot::unpack_q4_group(wq, group_scales<uint16_t>(w.scale, g, nb), group_scales<uint16_t>(w.offset, g, nb), nb,
                              unpacked.data());
      else
        qdot::unpack_q4_group(wq, group_scales<float>(w.scale, g, nb), group_scales<float>(w.offset, g, nb), nb,
                              unpacked.data());
      wq = unpacked.data();
    }
    const int nc = int(std::min<int64_t>(QG, N - g * QG));
    for (int64_t t = 0; t < tiles; t++) {
      const int r = int(std::min<int64_t>(qdot::kAmxRows, M - t * qdot::kAmxRows));
      const char* p = packed + t * tile_bytes;
      alignas(64) float acc[qdot::kAmxRows * QG];
      const int8_t* digits = reinterpret_cast<const int8_t*>(p);
      const float* units = reinterpret_cast<const float*>(p + nb * 512);
      const bool prefetch = !q4 && t == 0;  // 4-bit weights were streamed (and prefetched) by the unpacking
      if (w.scale_format == CVK_SCALE_F16)
        qdot::amx_group_dot_upto<qdot::kAmxRows>(r, wq, group_scales<uint16_t>(w.scale, g, nb),
                                                 group_scales<uint16_t>(w.offset, g, nb), mid, digits, units, nb, acc,
                                                 prefetch);
      else
        qdot::amx_group_dot_upto<qdot::kAmxRows>(r, wq, group_scales<float>(w.scale, g, nb),
                                                 group_scales<float>(w.offset, g, nb), mid, digits, units, nb, acc,
                                                 prefetch);
      store_group(acc, QG, r, nc, static_cast<const T*>(a.bias), static_cast<T*>(a.y), a.y_stride,
                  t * qdot::kAmxRows, g * QG);
    }
  }
  if (configured) amx_release();
}

// The activations quantized once, then each part of the weight (w, w->next, ...: cvk.h) into its columns.
template <typename T>
void quant_gemm_impl(const CvkQuantGemmArgs& a) {
  const CvkQuantWeight& w = *a.w;
  const int64_t M = a.M, KP = w.KP, rb = quant_row_bytes(KP);
  const T* x = static_cast<const T*>(a.x);
  char* scratch = static_cast<char*>(a.scratch);
  on_team(a.num_threads, [&] {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * a.x_stride, w.K, KP, scratch + m * rb);
    int64_t n0 = 0;
    for (const CvkQuantWeight* part = &w; part != nullptr; n0 += part->N, part = part->next) {
      CvkQuantGemmArgs pa = a;
      pa.w = part;
      pa.y = static_cast<T*>(a.y) + n0;
      pa.bias = a.bias != nullptr ? static_cast<const T*>(a.bias) + n0 : nullptr;
      if (takes_amx(M, *part))
        amx_groups<T>(pa, scratch, rb, scratch + M * rb);  // quant_scratch_bytes' second part
      else
        vector_groups<T>(pa, scratch, rb);
    }
  });
}

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

bool valid_part(const CvkQuantWeight* w) {
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
bool valid(const CvkQuantWeight* w) {
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

int64_t total_rows(const CvkQuantWeight& w) {
  int64_t n = 0;
  for (const CvkQuantWeight* p = &w; p != nullptr; p = p->next) n += p->N;
  return n;
}

}  // namespace

int64_t quant_row_bytes(int64_t KP) { return (2 * KP + 16 * blocks(KP) + 63) / 64 * 64; }  // QRow's arrays

// The rows (quant_row_bytes each), then, when a step of M rows takes the AMX loop, its packed tiles
// (amx_groups): one buffer the caller owns, so that inside the layer stack's parallel region every thread reads
// the same one.
int64_t quant_scratch_bytes(int64_t M, int64_t KP) {
  // for a weight of either kind (the layer stack sizes one scratch for all its linears)
  const bool amx = takes_amx(M, CVK_Q4) || takes_amx(M, CVK_Q8);
  const int64_t tiles = amx ? (M + qdot::kAmxRows - 1) / qdot::kAmxRows : 0;
  return M * quant_row_bytes(KP) + tiles * amx_tile_bytes(KP);
}

int quant_gemm(const CvkQuantGemmArgs& a) {
  if (!valid(a.w)) return CVK_ERR_BADARG;
  if (a.M <= 0) return CVK_OK;
  if (a.scratch_bytes < quant_scratch_bytes(a.M, a.w->KP)) return CVK_ERR_BADARG;
  if (a.w->kind == CVK_W8A8) return w8a8_gemm(a);  // per-token 8-bit activations (gemm_w8a8.cpp)
  if (a.dtype == CVK_F32)
    quant_gemm_impl<float>(a);
  else if (a.dtype == CVK_BF16)
    quant_gemm_impl<uint16_t>(a);
  else
    return CVK_ERR_BADARG;
  return CVK_OK;
}

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
