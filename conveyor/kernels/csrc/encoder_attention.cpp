// Bidirectional (non-causal) attention over a step's packed sequences (cvk_encoder_attention): a BERT-family
// encoder's self-attention, one call per layer for every sequence of the step.
//
// Sequence s owns rows [cu_seqlens[s], cu_seqlens[s + 1]) of the packed token axis (flash-attention's varlen
// layout); its queries see every key of its own sequence and nothing else. The work is split over (sequence, head,
// chunk of queries) items, all in one parallel region: the encoder's previous per-sequence SDPA calls each ended at
// a barrier, ~40 of them per layer (docs/embeddings.md).
//
// One item: its sequence's keys of one head are packed once (float32: K transposed, Kt [D][Lp]; bfloat16 on
// VDPBF16PS: pairs of d per key, Kp [D/2][Lp][2], and pairs of keys per d, Vp [Lp/2][D][2]), then its queries run
// in tiles of kQTile rows: scores S = q K^T for a block of keys in register blocks (a row's scores are held
// whole when the sequence fits a key block, kKeyBlock: the encoders' 512 positions do), an online softmax across
// key blocks (flash attention's running max and sum, float32), O += P V, and out = O / sum. Head sizes: any
// multiple of 16 up to kMaxD (BERT-base/large 64, MiniLM 32, 128). At head size 32 the exponentials are a third
// of the work, so the scores are kept in L1 and each passes through exp once.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "bf16.h"
#include "kernels.h"
#include "team.h"
#include "vec.h"

namespace cvk {
namespace {

constexpr int kQTile = 16;       // query rows whose scores are held at once
constexpr int kKeyBlock = 512;   // keys per softmax block (the online softmax spans blocks)
constexpr int kMaxD = 256;
constexpr int kRows = 4;         // query rows per register block (a tile's rows are padded to a multiple)
constexpr int kKeyVecs = W == 16 ? 4 : 2;  // key vectors per score register block (16 / 8 accumulators)
constexpr int kOutVecs = W == 16 ? 4 : 2;  // output vectors per P V register block

template <class T>
using Buf = std::vector<T, AlignedAlloc<T>>;

struct Item {
  int32_t seq, head, q0, q1;
  int64_t cost;
};

struct Scratch {
  Buf<float> kt;      // float path: Kt [D][Lp]
  Buf<uint16_t> kp;   // bfloat16 dot path: Kp [D/2][Lp][2]
  Buf<uint16_t> vp;   // bfloat16 dot path: Vp [Lp/2][D][2]
  Buf<float> q;       // float path: the tile's queries times scale [kQTile][D]
  Buf<float> s;       // scores, then probabilities [kQTile][kKeyBlock]
  Buf<uint16_t> pb;   // bfloat16 dot path: the probabilities rounded [kQTile][kKeyBlock]
  Buf<float> o;       // output accumulators [kQTile][D]
  float m[kQTile], l[kQTile];
};

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// ---- float32 arithmetic (every level; bfloat16 inputs widened when packed or loaded) ----

// S[r][0 : NV W] = q[r] . Kt[:, c0 ...] for kRows rows (q already scaled); S's rows kKeyBlock apart.
template <int NV>
inline void scores_f32(const float* q, int D, const float* kt, int64_t lp, int c0, float* S) {
  V acc[kRows][NV];
  for (int r = 0; r < kRows; r++)
    for (int n = 0; n < NV; n++) acc[r][n] = V::zero();
  for (int d = 0; d < D; d++) {
    V kv[NV];
    for (int n = 0; n < NV; n++) kv[n] = V::load(kt + d * lp + c0 + n * W);
    for (int r = 0; r < kRows; r++) {
      const V qb = V::set1(q[r * D + d]);
      for (int n = 0; n < NV; n++) acc[r][n] = V::fma(qb, kv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < kRows; r++)
    for (int n = 0; n < NV; n++) acc[r][n].store(S + r * kKeyBlock + n * W);
}

// O[r][d0 : d0 + NC W] += sum_j P[r][j] v[j][d0 ...] over kn keys, for R rows; v rows are the inputs' own.
template <class T, int R, int NC>
inline void pv_f32(const float* P, int kn, const T* v, int64_t v_stride, int d0, float* O, int D) {
  V acc[R][NC];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < NC; c++) acc[r][c] = V::load(O + r * D + d0 + c * W);
  for (int j = 0; j < kn; j++) {
    const T* vr = v + j * v_stride + d0;
    V vv[NC];
    for (int c = 0; c < NC; c++) vv[c] = V::load(vr + c * W);
    for (int r = 0; r < R; r++) {
      const V p = V::set1(P[r * kKeyBlock + j]);
      for (int c = 0; c < NC; c++) acc[r][c] = V::fma(p, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < NC; c++) acc[r][c].store(O + r * D + d0 + c * W);
}

#if defined(CVK_AVX512BF16)
// ---- bfloat16 dot products on VDPBF16PS (32 products an instruction, no conversions) ----

// S[r][0 : 16 NV] = scale * q[r] . K[c0 ...] for kRows rows: a broadcast pair (q[2p], q[2p+1]) against 16 keys'
// pairs of Kp.
template <int NV>
inline void scores_bf16(const uint16_t* const* qrow, int D, const uint16_t* kp, int64_t lp, int c0, float scale,
                        float* S) {
  __m512 acc[kRows][NV];
  for (int r = 0; r < kRows; r++)
    for (int n = 0; n < NV; n++) acc[r][n] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; p++) {
    __m512bh kv[NV];
    for (int n = 0; n < NV; n++) kv[n] = (__m512bh)_mm512_loadu_si512(kp + (p * lp + c0 + n * 16) * 2);
    for (int r = 0; r < kRows; r++) {
      uint32_t pair;
      memcpy(&pair, qrow[r] + 2 * p, 4);
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(int(pair));
      for (int n = 0; n < NV; n++) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], kv[n], qb);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < kRows; r++)
    for (int n = 0; n < NV; n++) _mm512_storeu_ps(S + r * kKeyBlock + n * 16, _mm512_mul_ps(acc[r][n], sc));
}

// O[r][d0 : d0 + 16 NC] += P[r] V over knp keys (even; the padding's P and V are zeros), in pairs of keys.
template <int R, int NC>
inline void pv_bf16(const uint16_t* Pb, int knp, const uint16_t* vp, int d0, float* O, int D) {
  __m512 acc[R][NC];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < NC; c++) acc[r][c] = _mm512_loadu_ps(O + r * D + d0 + c * 16);
  for (int jp = 0; jp < knp / 2; jp++) {
    __m512bh vv[NC];
    for (int c = 0; c < NC; c++) vv[c] = (__m512bh)_mm512_loadu_si512(vp + (int64_t(jp) * D + d0 + c * 16) * 2);
    for (int r = 0; r < R; r++) {
      uint32_t pair;
      memcpy(&pair, Pb + r * kKeyBlock + 2 * jp, 4);
      const __m512bh p = (__m512bh)_mm512_set1_epi32(int(pair));
      for (int c = 0; c < NC; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], p);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < NC; c++) _mm512_storeu_ps(O + r * D + d0 + c * 16, acc[r][c]);
}

// Kp [D/2][Lp][2] and Vp [Lp/2][D][2] of one head, the padding keys [L, Lp) zero.
inline void pack_bf16(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride, int L, int Lp, int D,
                      uint16_t* kp, uint16_t* vp) {
  uint32_t* kp32 = reinterpret_cast<uint32_t*>(kp);
  for (int j = 0; j < Lp; j++) {
    const uint16_t* kr = k + int64_t(j) * k_stride;
    for (int p = 0; p < D / 2; p++) {
      uint32_t pair = 0;
      if (j < L) memcpy(&pair, kr + 2 * p, 4);
      kp32[int64_t(p) * Lp + j] = pair;
    }
  }
  // out[2i] = row j's d, out[2i + 1] = row j + 1's d, for 16 d at a time
  const __m512i interleave_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                                 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i interleave_hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55,
                                                 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  for (int j = 0; j < Lp; j += 2) {
    uint16_t* out = vp + int64_t(j) * D;
    for (int d = 0; d < D; d += 32) {
      const int n = std::min(32, D - d);  // 16 or 32
      const __mmask32 m = n == 32 ? __mmask32(0xffffffffu) : __mmask32(0xffffu);
      const __m512i r0 = j < L ? _mm512_maskz_loadu_epi16(m, v + int64_t(j) * v_stride + d) : _mm512_setzero_si512();
      const __m512i r1 =
          j + 1 < L ? _mm512_maskz_loadu_epi16(m, v + int64_t(j + 1) * v_stride + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(r0, interleave_lo, r1));
      if (n == 32) _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(r0, interleave_hi, r1));
    }
  }
}

// The block's probabilities [0, kn) of rows [0, rows) rounded to bfloat16 for pv_bf16, the padding keys [kn, knp)
// zero.
inline void probs_to_bf16(const float* s_rows, uint16_t* pb_rows, int rows, int kn, int knp) {
  for (int r = 0; r < rows; r++) {
    const float* s = s_rows + r * kKeyBlock;
    uint16_t* pb = pb_rows + r * kKeyBlock;
    for (int j = 0; j < knp; j += 16) {
      const __m512 p = _mm512_maskz_loadu_ps(V::lanes(kn - j), s + j);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j), (__m256i)_mm512_cvtneps_pbh(p));
    }
  }
}
#else
template <int NV>
void scores_bf16(const uint16_t* const* qrow, int D, const uint16_t* kp, int64_t lp, int c0, float scale, float* S);
template <int R, int NC>
void pv_bf16(const uint16_t* Pb, int knp, const uint16_t* vp, int d0, float* O, int D);
void pack_bf16(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride, int L, int Lp, int D,
               uint16_t* kp, uint16_t* vp);
void probs_to_bf16(const float* s_rows, uint16_t* pb_rows, int rows, int kn, int knp);
#endif

// Softmax step of one key block for rows [0, rows): S[r][0, kn) -> exp(S - running max), the running max and sum
// updated, O rows rescaled when the max moved (blocks after the first).
inline void softmax_block(Scratch& sc, int rows, int kn, int D, bool first) {
  for (int r = 0; r < rows; r++) {
    float* s = sc.s.data() + r * kKeyBlock;
    V mv = V::set1(-INFINITY);
    int j = 0;
    for (; j + W <= kn; j += W) mv = V::max(mv, V::load(s + j));
    float mx = mv.hmax();
    for (; j < kn; j++) mx = std::max(mx, s[j]);
    const float m_new = std::max(sc.m[r], mx);
    const V mb = V::set1(m_new);
    V sum = V::zero();
    for (j = 0; j + W <= kn; j += W) {
      const V p = V::exp(V::load(s + j) - mb);
      p.store(s + j);
      sum = sum + p;
    }
    float tail = 0.0f;
    for (; j < kn; j++) tail += (s[j] = expf(s[j] - m_new));
    const float alpha = first ? 0.0f : expf(sc.m[r] - m_new);
    sc.l[r] = sc.l[r] * alpha + sum.sum() + tail;
    sc.m[r] = m_new;
    if (!first && alpha != 1.0f) {
      float* o = sc.o.data() + r * D;
      for (int d = 0; d < D; d += W) (V::load(o + d) * V::set1(alpha)).store(o + d);
    }
  }
}

template <class T, bool DOT>
void run_item(const CvkEncoderAttnArgs& a, const Item& it, Scratch& sc) {
  const int D = a.D, group = a.H / a.KVH, kvh = it.head / group;
  const int64_t base = a.cu_seqlens[it.seq];
  const int L = int(a.cu_seqlens[it.seq + 1] - base);
  const int Lp = round_up(L, W);
  const T* q = static_cast<const T*>(a.q) + base * a.q_stride + int64_t(it.head) * D;
  const T* k = static_cast<const T*>(a.k) + base * a.k_stride + int64_t(kvh) * D;
  const T* v = static_cast<const T*>(a.v) + base * a.v_stride + int64_t(kvh) * D;
  T* out = static_cast<T*>(a.out) + base * a.out_stride + int64_t(it.head) * D;

  if constexpr (DOT) {
    pack_bf16(reinterpret_cast<const uint16_t*>(k), a.k_stride, reinterpret_cast<const uint16_t*>(v), a.v_stride, L,
              Lp, D, sc.kp.data(), sc.vp.data());
  } else {
    float* kt = sc.kt.data();
    for (int j = 0; j < L; j++) {
      const T* kr = k + int64_t(j) * a.k_stride;
      for (int d = 0; d < D; d++) kt[int64_t(d) * Lp + j] = to_f32(kr[d]);
    }
    for (int d = 0; d < D; d++)
      for (int j = L; j < Lp; j++) kt[int64_t(d) * Lp + j] = 0.0f;
  }

  for (int t0 = it.q0; t0 < it.q1; t0 += kQTile) {
    const int nr = std::min(kQTile, it.q1 - t0), rows = round_up(nr, kRows);
    const uint16_t* qrow[kQTile];
    if constexpr (DOT) {
      // padding rows repeat the tile's last query: finite scores, never stored
      for (int r = 0; r < rows; r++)
        qrow[r] = reinterpret_cast<const uint16_t*>(q + int64_t(t0 + std::min(r, nr - 1)) * a.q_stride);
    } else {
      for (int r = 0; r < rows; r++) {
        float* qs = sc.q.data() + r * D;
        const T* qr = q + int64_t(t0 + std::min(r, nr - 1)) * a.q_stride;
        for (int d = 0; d < D; d++) qs[d] = to_f32(qr[d]) * a.scale;
      }
    }
    for (int r = 0; r < rows; r++) sc.m[r] = -INFINITY, sc.l[r] = 0.0f;
    memset(sc.o.data(), 0, sizeof(float) * rows * D);

    for (int kb0 = 0; kb0 < L; kb0 += kKeyBlock) {
      const int kn = std::min(kKeyBlock, L - kb0), knp = round_up(kn, W);
      for (int r0 = 0; r0 < rows; r0 += kRows) {
        for (int c0 = kb0; c0 < kb0 + knp; c0 += kKeyVecs * W) {
          const int nv = std::min(kKeyVecs, (kb0 + knp - c0) / W);
          float* S = sc.s.data() + r0 * kKeyBlock + (c0 - kb0);  // the block's column of key c0
#define CVK_SCORES(NV)                                                                        \
  if constexpr (DOT)                                                                          \
    scores_bf16<NV>(qrow + r0, D, sc.kp.data(), Lp, c0, a.scale, S);                          \
  else                                                                                        \
    scores_f32<NV>(sc.q.data() + r0 * D, D, sc.kt.data(), Lp, c0, S);
          switch (nv) {
            case 4: { CVK_SCORES((kKeyVecs >= 4 ? 4 : 1)) } break;
            case 3: { CVK_SCORES((kKeyVecs >= 3 ? 3 : 1)) } break;
            case 2: { CVK_SCORES(2) } break;
            default: { CVK_SCORES(1) } break;
          }
#undef CVK_SCORES
        }
      }
      softmax_block(sc, rows, kn, D, kb0 == 0);
      if constexpr (DOT) probs_to_bf16(sc.s.data(), sc.pb.data(), rows, kn, knp);
      for (int d0 = 0; d0 < D; d0 += kOutVecs * W) {
        const int nc = std::min(kOutVecs, (D - d0) / W);
        for (int r0 = 0; r0 < rows; r0 += kRows) {
          float* O = sc.o.data() + r0 * D;
#define CVK_PV(NC)                                                                                           \
  if constexpr (DOT)                                                                                         \
    pv_bf16<kRows, NC>(sc.pb.data() + r0 * kKeyBlock, knp, sc.vp.data() + int64_t(kb0) * D, d0, O, D);      \
  else                                                                                                       \
    pv_f32<T, kRows, NC>(sc.s.data() + r0 * kKeyBlock, kn, v + int64_t(kb0) * a.v_stride, a.v_stride, d0, O, D);
          switch (nc) {
            case 4: { CVK_PV((kOutVecs >= 4 ? 4 : 1)) } break;
            case 3: { CVK_PV((kOutVecs >= 3 ? 3 : 1)) } break;
            case 2: { CVK_PV(2) } break;
            default: { CVK_PV(1) } break;
          }
#undef CVK_PV
        }
      }
    }
    for (int r = 0; r < nr; r++) {
      const float* o = sc.o.data() + r * D;
      const V inv = V::set1(1.0f / sc.l[r]);
      T* orow = out + int64_t(t0 + r) * a.out_stride;
      for (int d = 0; d < D; d += W) (V::load(o + d) * inv).store(orow + d);
    }
  }
}

template <class T, bool DOT>
void run(const CvkEncoderAttnArgs& a, const std::vector<Item>& items, int max_len) {
  const int64_t n = int64_t(items.size());
  const int Lp = round_up(max_len, W);
  on_team(std::max(1, int(a.num_threads)), [&] {
    Scratch sc;
    if (DOT) {
      sc.kp.resize(size_t(Lp) * a.D);
      sc.vp.resize(size_t(Lp) * a.D);
      sc.pb.resize(size_t(kQTile) * kKeyBlock);
    } else {
      sc.kt.resize(size_t(Lp) * a.D);
      sc.q.resize(size_t(kQTile) * a.D);
    }
    sc.s.resize(size_t(kQTile) * kKeyBlock);
    sc.o.resize(size_t(kQTile) * a.D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; i++) run_item<T, DOT>(a, items[i], sc);
  });
}

}  // namespace

int encoder_attention(const CvkEncoderAttnArgs& a) {
  if (a.dtype != CVK_F32 && a.dtype != CVK_BF16) return CVK_ERR_BADARG;
  if (a.num_seqs < 0 || a.H <= 0 || a.KVH <= 0 || a.D <= 0) return CVK_ERR_BADARG;
  if (a.D % 16 != 0 || a.D > kMaxD || a.H % a.KVH != 0) return CVK_ERR_UNSUPPORTED;
  if (a.num_seqs == 0) return CVK_OK;
  if (a.cu_seqlens[0] != 0) return CVK_ERR_BADARG;
  int max_len = 0;
  for (int s = 0; s < a.num_seqs; s++) {
    const int64_t len = a.cu_seqlens[s + 1] - a.cu_seqlens[s];
    if (len < 0 || len > (int64_t(1) << 30)) return CVK_ERR_BADARG;
    max_len = std::max(max_len, int(len));
  }
  // Items: (sequence, head, chunk of queries); a sequence's queries are split only when the step has too few
  // (sequence, head) pairs to keep every thread busy, since each item packs its head's keys once.
  const int threads = std::max(1, int(a.num_threads));
  const int64_t pairs = int64_t(a.num_seqs) * a.H;
  const int64_t split = std::max<int64_t>(1, (4 * threads + pairs - 1) / pairs);
  std::vector<Item> items;
  items.reserve(size_t(pairs));
  for (int s = 0; s < a.num_seqs; s++) {
    const int L = int(a.cu_seqlens[s + 1] - a.cu_seqlens[s]);
    if (L == 0) continue;
    const int chunks = int(std::min<int64_t>(split, (L + kQTile - 1) / kQTile));
    const int rows = round_up((L + chunks - 1) / chunks, kQTile);
    for (int h = 0; h < a.H; h++)
      for (int q0 = 0; q0 < L; q0 += rows) items.push_back({s, h, q0, std::min(L, q0 + rows), int64_t(L) * rows});
  }
  // longest first: the dynamic schedule then ends with the short items, evenly
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  if (a.dtype == CVK_F32)
    run<float, false>(a, items, max_len);
  else if (kBf16Dot)
    run<uint16_t, kBf16Dot>(a, items, max_len);
  else
    run<uint16_t, false>(a, items, max_len);
  return CVK_OK;
}

}  // namespace cvk
