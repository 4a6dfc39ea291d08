"""A small C kernel for batched paged decode attention on CPU, compiled on first use and loaded with ctypes.

Why: torch has no paged attention op on CPU, so the torch path must first gather every decode's K/V blocks
into a padded tensor (write + read again) and then run SDPA: at 100 decodes x ~300 tokens of context that was
~75 ms of a ~140 ms step here. This kernel reads K/V straight from the cache through the block table, once.
It is plain C (no torch headers: builds in about a second with the system compiler), cached by source hash
under ~/.cache/conveyor, and optional: ``load_kernel()`` returns None when there is no compiler (or
CONVEYOR_NO_C_KERNEL=1), and the backend falls back to the torch path.
Threads: requests are shared out dynamically over torch's own OpenMP pool (see the C source).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings

import torch

SOURCE = r"""
#include <math.h>
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

typedef struct {
    const float *q, *k_cache, *v_cache; const int64_t *block_table, *seq_lens; float *out;
    int64_t bt_stride; int H, KVH, D, bs; float scale;
} Args;

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FAST 1
/* Eight dot-product accumulators -> one vector of their eight sums (a transpose-add tree). */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
/* scores[t] = scale * q . k_t for 8 consecutive K rows (row stride `row`), nd = D / 8 vectors each. */
static inline void qk8(const float *q, const float *k, int64_t row, int nd, float scale, float *scores) {
    __m256 acc[8];
    for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
    for (int j = 0; j < nd; j++) {
        const __m256 qv = _mm256_loadu_ps(q + 8 * j);
        for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + u * row + 8 * j), acc[u]);
    }
    _mm256_storeu_ps(scores, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
}
/* o += sum_t p[t] * v_t over n V rows, accumulating in registers (ND = D / 8, a compile-time constant). */
static inline void pv(const float *p, const float *v, int64_t row, int n, float *o, const int ND) {
    __m256 acc[16];
    for (int j = 0; j < ND; j++) acc[j] = _mm256_loadu_ps(o + 8 * j);
    for (int t = 0; t < n; t++, v += row) {
        const __m256 pt = _mm256_set1_ps(p[t]);
        for (int j = 0; j < ND; j++) acc[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * j), acc[j]);
    }
    for (int j = 0; j < ND; j++) _mm256_storeu_ps(o + 8 * j, acc[j]);
}
#else
#define FAST 0
#endif

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.f;
    for (int d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

/* One request: all its query heads over its context, walked block by block. K, then V, are each streamed from
   memory once: within a block, the rows stay in L1 while every query head of their kv head uses them. */
static void attend_item(const Args *a, int b, float *scores) {
    const int H = a->H, D = a->D, G = a->H / a->KVH, L = (int)a->seq_lens[b], bs = a->bs;
    const int64_t *table = a->block_table + (int64_t)b * a->bt_stride;
    const float *q = a->q + (int64_t)b * H * D;
    const int64_t row = (int64_t)a->KVH * D;
    const int vec = FAST && D % 8 == 0 && D <= 128;
    for (int start = 0, blk = 0; start < L; start += bs, blk++) {
        const float *k = a->k_cache + table[blk] * bs * row;
        const int n = L - start < bs ? L - start : bs;
        int t = 0;
#if FAST
        if (vec)
            for (; t + 8 <= n; t += 8)
                for (int h = 0; h < H; h++)
                    qk8(q + (int64_t)h * D, k + t * row + (int64_t)(h / G) * D, row, D / 8, a->scale,
                        scores + (int64_t)h * L + start + t);
#endif
        for (; t < n; t++)
            for (int h = 0; h < H; h++)
                scores[(int64_t)h * L + start + t] = dot(q + (int64_t)h * D, k + t * row + (int64_t)(h / G) * D, D) * a->scale;
    }
    for (int h = 0; h < H; h++) {
        float *s = scores + (int64_t)h * L, m = -FLT_MAX, sum = 0.f;
        for (int l = 0; l < L; l++) m = s[l] > m ? s[l] : m;
        for (int l = 0; l < L; l++) { s[l] = expf(s[l] - m); sum += s[l]; }
        const float inv = 1.f / sum;
        for (int l = 0; l < L; l++) s[l] *= inv;
    }
    float *o = a->out + (int64_t)b * H * D;
    for (int i = 0; i < H * D; i++) o[i] = 0.f;
    for (int start = 0, blk = 0; start < L; start += bs, blk++) {
        const float *v = a->v_cache + table[blk] * bs * row;
        const int n = L - start < bs ? L - start : bs;
        for (int h = 0; h < H; h++) {
            const float *p = scores + (int64_t)h * L + start, *vh = v + (int64_t)(h / G) * D;
            float *oh = o + (int64_t)h * D;
#if FAST
            if (vec && D == 64) { pv(p, vh, row, n, oh, 8); continue; }
            if (vec && D == 128) { pv(p, vh, row, n, oh, 16); continue; }
#endif
            for (int t = 0; t < n; t++)
                for (int d = 0; d < D; d++) oh[d] += p[t] * vh[t * row + d];
        }
    }
}

/* q, out: [B, H, D]; k_cache, v_cache: [num_blocks, bs, KVH, D]; block_table: [B, bt_stride]; seq_lens: [B].
   Runs on the OpenMP pool: linked by soname against the libgomp torch already loaded, so these are torch's
   own intra-op threads (a separate thread pool would fight torch's spinning workers for the same cores). */
int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_table,
                           int64_t bt_stride, const int64_t *seq_lens, float *out, int B, int H, int KVH, int D,
                           int bs, float scale, int num_threads) {
    int max_len = 1;
    for (int b = 0; b < B; b++) if (seq_lens[b] > max_len) max_len = (int)seq_lens[b];
    const Args args = {q, k_cache, v_cache, block_table, seq_lens, out, bt_stride, H, KVH, D, bs, scale};
    int failed = 0;
    #pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)H * (size_t)max_len);
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int b = 0; b < B; b++) if (scores) attend_item(&args, b, scores);
        free(scores);
    }
    return failed ? -1 : 0;
}
"""

_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-fopenmp")
_lock = threading.Lock()
_loaded: dict[str, object] = {}


def _cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "conveyor", "kernels")


def _build(path: str) -> None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        src = os.path.join(tmp, "paged_decode.c")
        with open(src, "w") as f:
            f.write(SOURCE)
        lib = os.path.join(tmp, "lib.so")
        obj = os.path.join(tmp, "paged_decode.o")
        # Compile with -ffast-math but link without it: linking a shared library with -ffast-math pulls in
        # crtfastmath.o, which flips the whole process into flush-to-zero mode when the library is loaded.
        compile_cmd = [compiler, *_COMPILE_FLAGS, "-c", src, "-o", obj]
        link_cmd = [compiler, "-shared", "-fopenmp", obj, "-o", lib, "-lm"]
        for cmd in (compile_cmd, link_cmd):
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(lib, path)  # atomic: concurrent builders never load a half-written file


def load_kernel():
    """The compiled ``paged_decode_attention`` function, or None when it cannot be built here."""
    if os.environ.get("CONVEYOR_NO_C_KERNEL") == "1":
        return None
    key = hashlib.sha256((SOURCE + " ".join(_COMPILE_FLAGS)).encode()).hexdigest()[:16]
    with _lock:
        if key in _loaded:
            return _loaded[key]
        path = os.path.join(_cache_dir(), f"paged_decode_{key}.so")
        fn = None
        try:
            if not os.path.exists(path):
                _build(path)
            fn = ctypes.CDLL(path).paged_decode_attention
            fn.restype = ctypes.c_int
            p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            fn.argtypes = [p, p, p, p, i64, p, p, i, i, i, i, i, ctypes.c_float, i]
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            warnings.warn(f"conveyor: C decode-attention kernel unavailable ({e}); using the torch path")
            fn = None
        _loaded[key] = fn
        return fn


def paged_decode(fn, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, out: torch.Tensor) -> None:
    """out[B, H, D] = attention of q[B, H, D] (one query per request) over its paged context."""
    assert q.is_contiguous() and out.is_contiguous() and kv_cache.is_contiguous() and block_table.is_contiguous()
    num_blocks, bs, kv_heads, head_dim = kv_cache.shape[1:]
    rc = fn(q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_table.data_ptr(),
            block_table.shape[1], seq_lens.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1], kv_heads, head_dim, bs,
            scale, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged decode kernel could not allocate its score buffer")
