#!/usr/bin/env python3
"""The batch-1 decode ceiling of a GGUF on this machine: memory read bandwidth over bytes read per token.

    python benchmarks/decode_ceiling.py --gguf PATH/a.gguf [--gguf PATH/b.gguf ...] [--threads 2] [--mib 1024]
        [--positions 200] [--llama-bench-tok-s 175]

A batch-1 decode step reads every weight once (the tied embedding once more as the lm_head; the lookup reads one
row) and the KV of every position so far, and on a model far larger than the last-level cache those bytes come
from memory. No engine can decode faster than bandwidth / bytes a token. The bandwidth is measured here: a small
C++ probe (compiled with the system's g++) streams a ``--mib`` buffer with ``--threads`` threads, best of 5. Bytes
per token are counted for both layouts: llama.cpp reads the file's blocks (and an f16 KV cache); conveyor reads its
packed form (``layers/quantized.py``: the file's bytes for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and Q6_K; Q4_K 0.578 and
Q5_K 0.703, a byte per 6-bit sub-scale) and a float32 KV cache by default. ``--positions``: the positions a
step attends to on average (a 64-token prompt and a 256-token reply: about 200). ``--llama-bench-tok-s``: print
what fraction of the ceiling 1.5x that rate would take.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

PROBE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <chrono>
#include <thread>
#include <vector>
static void read_part(const uint8_t* p, size_t n, uint64_t* out) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i*)(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i*)(p + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i*)(p + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i*)(p + i + 96)));
  }
  a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  *out = (uint64_t)_mm256_extract_epi64(a0, 0) ^ (uint64_t)_mm256_extract_epi64(a0, 3);
}
int main(int argc, char** argv) {
  size_t n = (size_t)atol(argv[1]) << 20;
  int threads = atoi(argv[2]);
  uint8_t* p = (uint8_t*)aligned_alloc(4096, n);
  memset(p, 1, n);
  double best = 0;
  uint64_t sink = 0;
  for (int r = 0; r < 5; r++) {
    std::vector<uint64_t> outs(threads);
    std::vector<std::thread> team;
    auto t0 = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; t++) team.emplace_back(read_part, p + t * (n / threads), n / threads, &outs[t]);
    for (auto& t : team) t.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (auto o : outs) sink ^= o;
    if (n / s > best) best = n / s;
  }
  printf("%.3f %d\n", best / 1e9, (int)(sink & 1));
  return 0;
}
"""

# Bytes a value of each GGUF type takes in conveyor's packed layout (layers/quantized.py's module doc); a type not
# named here is counted at the file's bytes.
CONVEYOR_BYTES_PER_VALUE = {"Q8_0": 1.0625, "Q4_0": 0.5625, "Q4_1": 0.625, "Q5_0": 0.6875, "Q5_1": 0.75,
                            "Q4_K": 0.578, "Q5_K": 0.703, "Q6_K": 0.8203}


def read_bandwidth_gb_s(mib: int, threads: int) -> float:
    """Best of 5 streaming reads of a ``mib`` MiB buffer split over ``threads`` threads, GB/s."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe")
        with open(src, "w") as f:
            f.write(PROBE)
        subprocess.run(["g++", "-O2", "-mavx2", "-pthread", src, "-o", exe], check=True)
        out = subprocess.run([exe, str(mib), str(threads)], check=True, capture_output=True, text=True).stdout
    return float(out.split()[0])


def bytes_per_token(path: str, positions: int) -> dict:
    """Bytes one batch-1 decode step reads, per engine's layout: weights (the tied embedding again as the lm_head)
    and KV (llama.cpp f16, conveyor float32 by default)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = {f.name: f for f in reader.fields.values()}

    def meta(suffix: str) -> int:
        name = next(n for n in fields if n.endswith(suffix))
        return int(fields[name].parts[fields[name].data[0]][0])

    file_bytes = conveyor_bytes = 0.0
    tied, types = all(t.name != "output.weight" for t in reader.tensors), {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        n_bytes = float(t.n_bytes)
        values = float(t.n_elements)
        per = CONVEYOR_BYTES_PER_VALUE.get(kind)
        mine = values * per if per is not None else n_bytes
        if t.name == "token_embd.weight":
            rows = int(t.shape[-1])  # GGUF shapes list the row length first
            n_bytes, mine = n_bytes / rows, mine / rows  # the lookup reads one row...
            if tied:  # ...and, tied, the lm_head reads it all (output.weight is counted on its own otherwise)
                n_bytes, mine = n_bytes * (rows + 1), mine * (rows + 1)
        types[kind] = types.get(kind, 0) + int(t.n_bytes)
        file_bytes += n_bytes
        conveyor_bytes += mine
    layers, kv_heads = meta(".block_count"), meta(".attention.head_count_kv")
    head_dim = meta(".embedding_length") // meta(".attention.head_count")
    kv_values = 2 * layers * kv_heads * head_dim * positions
    return dict(types=types, llama_weights=file_bytes, conveyor_weights=conveyor_bytes, llama_kv=2.0 * kv_values,
                conveyor_kv=4.0 * kv_values)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", action="append", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--mib", type=int, default=1024, help="the probe's buffer, MiB (far beyond the caches)")
    ap.add_argument("--positions", type=int, default=200, help="positions a decode step attends to, on average")
    ap.add_argument("--llama-bench-tok-s", type=float, default=None)
    ns = ap.parse_args(argv)
    bw = read_bandwidth_gb_s(ns.mib, ns.threads)
    print(f"read bandwidth, {ns.threads} threads, {ns.mib} MiB: {bw:.1f} GB/s")
    for path in ns.gguf:
        b = bytes_per_token(path, ns.positions)
        print(f"{os.path.basename(path)}: tensors {', '.join(f'{k} {v / 1e6:.1f} MB' for k, v in b['types'].items())}")
        for engine in ("llama", "conveyor"):
            total = b[f"{engine}_weights"] + b[f"{engine}_kv"]
            line = (f"  {engine + '.cpp' if engine == 'llama' else engine}: {b[f'{engine}_weights'] / 1e6:.1f} MB "
                    f"weights + {b[f'{engine}_kv'] / 1e6:.1f} MB KV a token: ceiling {bw * 1e9 / total:.0f} tok/s")
            if ns.llama_bench_tok_s:
                line += f"; 1.5x llama-bench ({1.5 * ns.llama_bench_tok_s:.0f} tok/s) is " \
                        f"{1.5 * ns.llama_bench_tok_s * total / (bw * 1e9):.0%} of it"
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
