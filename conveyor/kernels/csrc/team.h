// Threads and scratch memory shared by the kernels. Threads are OpenMP, linked by soname against the libgomp
// torch has already loaded, so they are torch's own intra-op threads (a second pool would fight torch's
// spinning workers for the same cores).
#pragma once

#include <omp.h>
#include <stdlib.h>

namespace cvk {

// Runs `body` on a team of `threads` OpenMP threads, or, when called from inside a parallel region (the
// decoder-layer stack opens one per step: cvk_llama_layers), on that region's team, every thread of which
// calls it. The kernels' loops are orphaned `omp for`s, so they share out over whichever team runs them, and
// each ends with the loop's barrier. One region per step instead of one per kernel call: a fork/join cost
// several times a barrier here, and a step of SmolLM2 made about 150 of them.
template <class Body>
inline void on_team(int threads, Body&& body) {
  if (omp_in_parallel()) {
    body();
  } else {
#pragma omp parallel num_threads(threads)
    body();
  }
}

// 64-byte aligned storage for std::vector (aligned vector loads and stores of per-thread scratch).
template <typename T>
struct AlignedAlloc {
  using value_type = T;
  AlignedAlloc() = default;
  template <typename U>
  AlignedAlloc(const AlignedAlloc<U>&) {}
  T* allocate(size_t n) {
    void* p = aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (!p) abort();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { free(p); }
  template <typename U>
  bool operator==(const AlignedAlloc<U>&) const { return true; }
  template <typename U>
  bool operator!=(const AlignedAlloc<U>&) const { return false; }
};

}  // namespace cvk
