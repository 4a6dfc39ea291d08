// The integer dot products of the quantized GEMM (gemm_quant.cpp) at 512 bits: one 64-byte load is 16 columns x
// 4 k, multiplied against 4 activation bytes broadcast to every lane, by VPDPBUSD where the level has
// AVX512_VNNI (CVK_VNNI), by VPMADDUBSW + VPMADDWD otherwise. Included by qdot.h only.
#pragma once

namespace cvk {
namespace qdot {

constexpr int kRows = 4;  // activation rows per register tile: 8 weight + 4 accumulator vectors + temporaries

// 16 integers n (|n| <= kActMax) -> their base-255 digits (qdot.h), stored as int8.
inline void store_digits(__m512i n, int8_t* hi, int8_t* lo) {
  const __m512i h = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(1.f / kDigit)));
  const __m512i l = _mm512_sub_epi32(n, _mm512_sub_epi32(_mm512_slli_epi32(h, 8), h));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtsepi32_epi8(h));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtsepi32_epi8(l));
}

// One block of 32 floats -> its integers n (qdot.h) as digits, its unit d (max |x| / kActMax), d * sum(n), and
// sum(n) of each half (hs[0], hs[1]).
inline void quantize_block(const float* x, int8_t* hi, int8_t* lo, float* d, float* s, int32_t* hs) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float id = amax > 0.f ? float(kActMax) / amax : 0.f;
  const __m512i n0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
  const __m512i n1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
  store_digits(n0, hi, lo);
  store_digits(n1, hi + 16, lo + 16);
  *d = amax / float(kActMax);
  hs[0] = _mm512_reduce_add_epi32(n0);
  hs[1] = _mm512_reduce_add_epi32(n1);
  *s = *d * float(hs[0] + hs[1]);
}

// The block's 8 quads of weights, 16 columns x 4 k each, as unsigned bytes. 5-bit q (CVK_Q5): the nibbles as
// 4-bit q's, then bit t of byte 4i + b of the 64-byte plane after them is q's fifth bit of quad t, moved to bit 4
// by a 16-bit shift (bit t of a byte lands on bit 4 of the same byte; the 0x10 mask drops what crossed over) and
// ORed in by one VPTERNLOGD.
template <int Bits>
CVK_QDOT_INLINE void load_block(const uint8_t* qs, __m512i w[8]) {
  if constexpr (Bits < 8) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int u = 0; u < 4; u++) {
      const __m512i v = _mm512_loadu_si512(qs + u * 64);
      w[2 * u] = _mm512_and_si512(v, m4);
      w[2 * u + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    if constexpr (Bits == 5) {
      const __m512i h = _mm512_loadu_si512(qs + 256), bit4 = _mm512_set1_epi8(0x10);
      w[0] = _mm512_ternarylogic_epi32(w[0], _mm512_slli_epi16(h, 4), bit4, 0xF8);  // a | (b & c)
      w[1] = _mm512_ternarylogic_epi32(w[1], _mm512_slli_epi16(h, 3), bit4, 0xF8);
      w[2] = _mm512_ternarylogic_epi32(w[2], _mm512_slli_epi16(h, 2), bit4, 0xF8);
      w[3] = _mm512_ternarylogic_epi32(w[3], _mm512_slli_epi16(h, 1), bit4, 0xF8);
      w[4] = _mm512_ternarylogic_epi32(w[4], h, bit4, 0xF8);
      w[5] = _mm512_ternarylogic_epi32(w[5], _mm512_srli_epi16(h, 1), bit4, 0xF8);
      w[6] = _mm512_ternarylogic_epi32(w[6], _mm512_srli_epi16(h, 2), bit4, 0xF8);
      w[7] = _mm512_ternarylogic_epi32(w[7], _mm512_srli_epi16(h, 3), bit4, 0xF8);
    }
  } else {
    for (int t = 0; t < 8; t++) w[t] = _mm512_loadu_si512(qs + t * 64);
  }
}

// A group's nb 5-bit blocks (CVK_Q5) as 8-bit ones (512 bytes: the CVK_Q8 order), q unchanged: a step of more
// rows than a register tile then moves the fifth bits once per block, not once per tile of rows (group_dot's
// Expanded). This pass streams the group from memory, so it asks for the weights ahead as group_dot does.
template <typename S>
inline void expand_q5_group(const uint8_t* qs, const S* scale, const S* offset, int64_t nb, uint8_t* out) {
  for (int64_t j = 0; j < nb; j++) {
    prefetch_block<5>(qs, scale, offset, j);
    __m512i w[8];
    load_block<5>(qs + j * kBlockBytes<5>, w);
    for (int t = 0; t < 8; t++) _mm512_store_si512(out + j * 512 + t * 64, w[t]);
  }
}

// Sum over the block's 32 k of w (unsigned) x one digit of x (signed), per column, as int32 lanes.
template <int Bits>
CVK_QDOT_INLINE __m512i digit_dot(const __m512i w[8], const int8_t* xq) {
  int32_t quads[8];
  memcpy(quads, xq, 32);
  __m512i d = _mm512_setzero_si512();
#if defined(CVK_VNNI)
  for (int t = 0; t < 8; t++) d = _mm512_dpbusd_epi32(d, w[t], _mm512_set1_epi32(quads[t]));
#else
  const __m512i ones = _mm512_set1_epi16(1);
  for (int t = 0; t < 8; t++) {
    const __m512i x = _mm512_set1_epi32(quads[t]);
    __m512i p;
    if constexpr (Bits < 8) {  // weights <= 31: VPMADDUBSW's int16 pair sums (2 x 31 x 127) cannot saturate
      p = _mm512_maddubs_epi16(w[t], x);
    } else {  // weights up to 255 would: multiply |q - 128| by x carrying q - 128's sign instead
      const __m512i ws = _mm512_xor_si512(w[t], _mm512_set1_epi8(char(0x80)));
      const __m512i xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(ws), _mm512_setzero_si512(), x);
      p = _mm512_maddubs_epi16(_mm512_abs_epi8(ws), xs);
    }
    d = _mm512_add_epi32(d, _mm512_madd_epi16(p, ones));
  }
#endif
  return d;
}

// CVK_Q6: the block's 8 quads as bytes q in [0, 63]: the low 4 bits as load_block<true> reads them, the high 2
// from the 128 bytes after them (cvk.h).
inline void load_block_q6(const uint8_t* qs, __m512i w[8]) {
  load_block<4>(qs, w);
  const __m512i m2 = _mm512_set1_epi8(0x03);
  for (int v = 0; v < 2; v++) {
    const __m512i h = _mm512_loadu_si512(qs + 256 + v * 64);
    for (int t = 0; t < 4; t++) {  // 16-bit shifts: the byte's 2 bits never cross into its neighbour (values <= 48)
      const __m512i bits = _mm512_and_si512(_mm512_srli_epi16(h, 2 * t), m2);
      w[4 * v + t] = _mm512_or_si512(w[4 * v + t], _mm512_slli_epi16(bits, 4));
    }
  }
}

// Per column, the sums over the block's first 16 k (quads 0-3) and its last 16 (quads 4-7) of w x one digit of
// x, for weights below 64 (VPMADDUBSW's pair sums, 2 x 63 x 127, cannot saturate).
inline void digit_dot_halves(const __m512i w[8], const int8_t* xq, __m512i& d0, __m512i& d1) {
  int32_t quads[8];
  memcpy(quads, xq, 32);
  __m512i d[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
#if defined(CVK_VNNI)
  for (int t = 0; t < 8; t++) d[t / 4] = _mm512_dpbusd_epi32(d[t / 4], w[t], _mm512_set1_epi32(quads[t]));
#else
  const __m512i ones = _mm512_set1_epi16(1);
  for (int t = 0; t < 8; t++) {
    const __m512i p = _mm512_maddubs_epi16(w[t], _mm512_set1_epi32(quads[t]));
    d[t / 4] = _mm512_add_epi32(d[t / 4], _mm512_madd_epi16(p, ones));
  }
#endif
  d0 = d[0];
  d1 = d[1];
}

// 255 h + l: the two digits' dot products recombined into <w, n> (qdot.h).
CVK_QDOT_INLINE __m512i combine_digits(__m512i h, __m512i l) {
  return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(h, 8), h), l);
}

// Sum over the block's 32 k of w x n per column: 255 <w, hi> + <w, lo>.
template <int Bits>
CVK_QDOT_INLINE __m512i block_dot(const __m512i w[8], const int8_t* hi, const int8_t* lo) {
  return combine_digits(digit_dot<Bits>(w, hi), digit_dot<Bits>(w, lo));
}

// One block's term added to a row's 16 column sums: scale_w * d_x * <q, n> + offset_w * s_x, in this order of
// roundings. The AMX loop (qdot_amx.h) adds its blocks with this same function, which is what keeps its output
// bit-identical to this loop's.
inline __m512 add_block(__m512 acc, __m512i dot, __m512 scale, __m512 offset, float d, float s) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(d)), acc);
  return _mm512_fmadd_ps(offset, _mm512_set1_ps(s), acc);
}

// 16 columns' scales (or offsets) of one block as float32: stored as float32, or as IEEE halves (cvk.h).
inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 offsets from element i of a group's offsets: stored, or mid * scale (the weight's kMidOffset, qdot.h) when
// it stores none.
template <typename S>
inline __m512 load_offsets(const S* offset, __m512 scale, int64_t i, float mid) {
  return offset != nullptr ? load_scales(offset + i) : _mm512_mul_ps(scale, _mm512_set1_ps(mid));
}

// 16 columns' K-quant sub-scales (or minimums) of one block (CVK_SCALE_KQUANT, cvk.h), bytes, as float32.
inline __m512 load_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Block j's 16 scales a and offsets b. S uint8_t: K-quant sub-scales and minimums (CVK_SCALE_KQUANT), times the
// super-block's d and -dmin (super: the group's [KP/256][2][16] halves), kept in ds / ms across its 8 blocks:
// d * sc and -dmin * m are exact in float32, the numbers a float32-scale packing holds.
template <int Bits, typename S>
inline void block_scales(const S* scale, const S* offset, const uint16_t* super, int64_t j, __m512& ds, __m512& ms,
                         __m512& a, __m512& b) {
  if constexpr (std::is_same_v<S, uint8_t>) {
    if (j % 8 == 0) {
      ds = load_scales(super + (j / 8) * 32);
      ms = _mm512_xor_ps(load_scales(super + (j / 8) * 32 + 16), _mm512_set1_ps(-0.f));
    }
    a = _mm512_mul_ps(ds, load_u8(scale + j * 16));
    b = _mm512_mul_ps(ms, load_u8(offset + j * 16));
  } else {
    a = load_scales(scale + j * 16);
    b = load_offsets(offset, a, j * 16, kMidOffset<Bits>);
  }
}

// Whether block_dot returned sum((q - 128) n) for 8-bit weights (the signed detour above) instead of sum(q x);
// the caller adds 128 * sum(n) back through the offset.
#if defined(CVK_VNNI)
constexpr bool kSignedQ8Dot = false;
#else
constexpr bool kSignedQ8Dot = true;
#endif

// out[r][0..16) = sum over blocks j of scale_j * d_rj * <q_j, n_rj> + offset_j * s_rj, for one group of 16
// columns and R rows (qs, scale, offset, super: the group's part of the weight; S float, uint16_t halves or
// uint8_t K-quant sub-scales with their super-scales, block_scales). prefetch:
// ask for the weights kPrefetchBlocks ahead (qdot.h), on the first pass over a group. Expanded: qs holds Bits-bit
// q laid out as 8-bit blocks (expand_q5_group).
template <int R, int Bits, typename S, bool Expanded = false>
inline void group_dot(const uint8_t* qs, const S* scale, const S* offset, const uint16_t* super, const QRow* xr,
                      int64_t nb, float* out, bool prefetch) {
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  constexpr int Layout = Expanded ? 8 : Bits;
  constexpr int64_t block_bytes = kBlockBytes<Layout>;
  __m512 ds = _mm512_setzero_ps(), ms = _mm512_setzero_ps();
  for (int64_t j = 0; j < nb; j++) {
    if (prefetch) prefetch_block<Layout>(qs, scale, offset, j);
    __m512i w[8];
    load_block<Layout>(qs + j * block_bytes, w);
    __m512 a, b;
    block_scales<Bits>(scale, offset, super, j, ds, ms, a, b);
    if constexpr (Bits == 8 && kSignedQ8Dot) b = _mm512_fmadd_ps(a, _mm512_set1_ps(128.f), b);
    for (int r = 0; r < R; r++) {
      acc[r] = add_block(acc[r], block_dot<Bits>(w, xr[r].hi + j * 32, xr[r].lo + j * 32), a, b, xr[r].d[j], xr[r].s[j]);
    }
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * 16, acc[r]);
}

// group_dot for a CVK_Q6 weight (cvk.h): sub int8 [nb][2][16] its sub-scales, super f16 [nb / 8][16]. Per
// sub-block h of 16 k: acc += (super * sub_h * d_x) * (<q, n>_h - 32 sum_h(n)), the bracket in integers.
template <int R>
inline void group_dot_q6(const uint8_t* qs, const int8_t* sub, const uint16_t* super, const QRow* xr, int64_t nb,
                         float* out, bool prefetch) {
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  __m512 ds = _mm512_setzero_ps();
  for (int64_t j = 0; j < nb; j++) {
    if (prefetch) prefetch_block_q6(qs, sub, j);
    if (j % 8 == 0) ds = load_scales(super + (j / 8) * 16);
    __m512i w[8];
    load_block_q6(qs + j * kQ6BlockBytes, w);
    const int8_t* sj = sub + j * 32;
    const __m512 a0 = _mm512_mul_ps(ds, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sj)))));
    const __m512 a1 = _mm512_mul_ps(ds, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sj + 16)))));
    for (int r = 0; r < R; r++) {
      __m512i h0, h1, l0, l1;
      digit_dot_halves(w, xr[r].hi + j * 32, h0, h1);
      digit_dot_halves(w, xr[r].lo + j * 32, l0, l1);
      const __m512i dot0 = _mm512_sub_epi32(combine_digits(h0, l0), _mm512_set1_epi32(kQ6Mid * xr[r].hs[2 * j]));
      const __m512i dot1 = _mm512_sub_epi32(combine_digits(h1, l1), _mm512_set1_epi32(kQ6Mid * xr[r].hs[2 * j + 1]));
      const __m512 d = _mm512_set1_ps(xr[r].d[j]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_mul_ps(a0, d), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(a1, d), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * 16, acc[r]);
}

// W8A8 (CVK_W8A8, gemm_w8a8.cpp): per-token 8-bit activations against per-channel int8 weights, whole-K integer
// sums. At this width the loop is served (kW8a8Dot); the AVX2 level has no such loop and leaves W8A8 to oneDNN.
constexpr bool kW8a8Dot = true;
constexpr int kW8a8Rows = 8;  // 2 groups x 8 rows = 16 accumulators, 2 weight vectors, the broadcast, temporaries

// acc += the 4-k dot products of one quad of weights (16 columns x 4 bytes q + 128) with 4 activation bytes
// broadcast to every lane: VPDPBUSD gives sum((q + 128) x); without VNNI, VPMADDUBSW on |q| against x carrying q's
// sign (|q| x |x| <= 127 x 127: the int16 pair sums cannot saturate) gives sum(q x) (kSignedQ8Dot).
inline __m512i w8a8_quad(__m512i acc, __m512i w, __m512i x) {
#if defined(CVK_VNNI)
  return _mm512_dpbusd_epi32(acc, w, x);
#else
  const __m512i ws = _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80)));
  const __m512i xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(ws), _mm512_setzero_si512(), x);
  const __m512i p = _mm512_maddubs_epi16(_mm512_abs_epi8(ws), xs);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#endif
}

// out_a / out_b [r][0..16) = sum over k of w[k][c] x_r[k] for two groups of 16 columns (qa, qb: each its nb blocks
// of 8 quads, bytes q + 128; qb may be qa) and R rows of int8 activations (x[r]: KP values): each broadcast of 4
// activation bytes feeds both groups. Exact in int32 for KP < 65536 (with VNNI, sum((q + 128) x): the caller takes
// 128 sum(x) back). prefetch: ask for both groups' weights kPrefetchBlocks ahead, on the first pass over them.
template <int R>
inline void w8a8_group_dot(const uint8_t* qa, const uint8_t* qb, const int8_t* const* x, int64_t nb, int32_t* out_a,
                           int32_t* out_b, bool prefetch) {
  __m512i acc_a[R], acc_b[R];
  for (int r = 0; r < R; r++) acc_a[r] = acc_b[r] = _mm512_setzero_si512();
  for (int64_t j = 0; j < nb; j++) {
    if (prefetch) {
      const uintptr_t off = uintptr_t((j + kPrefetchBlocks) * 512);
      for (int b = 0; b < 512; b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(qa) + off + b), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(qb) + off + b), _MM_HINT_T1);
      }
    }
    for (int t = 0; t < 8; t++) {
      const __m512i wa = _mm512_loadu_si512(qa + j * 512 + t * 64);
      const __m512i wb = _mm512_loadu_si512(qb + j * 512 + t * 64);
      for (int r = 0; r < R; r++) {
        int32_t quad;
        memcpy(&quad, x[r] + j * 32 + t * 4, 4);
        const __m512i xb = _mm512_set1_epi32(quad);
        acc_a[r] = w8a8_quad(acc_a[r], wa, xb);
        acc_b[r] = w8a8_quad(acc_b[r], wb, xb);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    _mm512_storeu_si512(out_a + r * 16, acc_a[r]);
    _mm512_storeu_si512(out_b + r * 16, acc_b[r]);
  }
}

}  // namespace qdot
}  // namespace cvk
