// The boilerplate every k3 native extension shares: the source digest compiled into the module, the CPU
// check the kernels need, and the run-time CPU features `k3 doctor` reports.
//
// Each extension's PYBIND11_MODULE calls K3_NATIVE_COMMON(m), which defines
//   source_hash            the digest k3/ops/extension.py passed as -DK3_NATIVE_SOURCE_HASH (a build from
//                          another source is detected and ignored by Python)
//   cpu_supported()        whether this CPU has AVX2 and FMA (the kernels are compiled with
//                          __attribute__((target)) per function, so the module loads on any x86-64 CPU)
//   cpu_features()         {feature: detected at run time} for avx2, fma, avx512f, avx512bw, avx512vl,
//                          avx512vnni, avx512bf16, amx-tile, amx-bf16 (as the compiler's
//                          __builtin_cpu_supports sees them)
// and, for the kernels with an AVX-512 variant, `k3_native::wide_variant` (the `variant` argument's check);
// `k3_native::empty_on_huge_pages` allocates the large fresh tensors the kernels return;
// `k3_native::parallel_chunks` splits a loop by demand among as many threads as torch uses (_native_pool.h).
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <string>

#include "_native_pool.h"

#ifndef K3_NATIVE_SOURCE_HASH
#define K3_NATIVE_SOURCE_HASH unknown
#endif
#define K3_STRINGIFY_VALUE(x) K3_STRINGIFY(x)
#define K3_STRINGIFY(x) #x

namespace k3_native {

inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

inline std::map<std::string, bool> cpu_features() {
  __builtin_cpu_init();
  return {
      {"avx2", static_cast<bool>(__builtin_cpu_supports("avx2"))},
      {"fma", static_cast<bool>(__builtin_cpu_supports("fma"))},
      {"avx512f", static_cast<bool>(__builtin_cpu_supports("avx512f"))},
      {"avx512bw", static_cast<bool>(__builtin_cpu_supports("avx512bw"))},
      {"avx512vl", static_cast<bool>(__builtin_cpu_supports("avx512vl"))},
      {"avx512vnni", static_cast<bool>(__builtin_cpu_supports("avx512vnni"))},
      {"avx512bf16", static_cast<bool>(__builtin_cpu_supports("avx512bf16"))},
      {"amx-tile", static_cast<bool>(__builtin_cpu_supports("amx-tile"))},
      {"amx-bf16", static_cast<bool>(__builtin_cpu_supports("amx-bf16"))},
  };
}

// Whether this CPU is an AMD of family 19h (Zen 3 and Zen 4), by cpuid.
inline bool cpu_is_amd_family_19h() {
  static const bool family_19h = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned base = (eax >> 8) & 0xF;
    const unsigned family = base == 0xF ? base + ((eax >> 20) & 0xFF) : base;
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") && family == 0x19;
  }();
  return family_19h;
}

// Whether this CPU is an AMD Zen 3: family 19h without AVX-512 (every Zen 4 has it). Its hardware prefetchers
// differ from Zen 4's, where most of the kernels' prefetching was measured, and two choices were measured
// apart on it: how the decode module reads short rows (`ask_short_tiles_ahead`, `read_short_rows_one_by_one`)
// and the int8 MXFP4 rows (VisitOrder).
inline bool cpu_is_zen3() {
  static const bool zen3 = cpu_is_amd_family_19h() && !__builtin_cpu_supports("avx512f");
  return zen3;
}

// Whether this CPU is an AMD Zen 4: family 19h with AVX-512. One choice was measured apart on it: whether the
// decode module's tiled BF16 rows at one vector ask for their lines ahead (`ask_tiled_rows_ahead`).
inline bool cpu_is_zen4() {
  static const bool zen4 = cpu_is_amd_family_19h() && __builtin_cpu_supports("avx512f");
  return zen4;
}

// Whether `variant` asks for a kernel's AVX-512 code: "auto" where this CPU has what that code needs
// (`supported`), "avx512" (an error without it; `needs` names the AVX-512 subsets), "avx2" never. Both give
// the same bits; the kernels take `variant` so that tests can compare the two.
inline bool wide_variant(const std::string& variant, bool supported, const char* needs) {
  TORCH_CHECK(variant == "auto" || variant == "avx2" || variant == "avx512",
              "variant must be 'auto', 'avx2' or 'avx512', got '", variant, "'");
  TORCH_CHECK(variant != "avx512" || supported, "this CPU lacks AVX-512 ", needs);
  return variant == "avx512" || (variant == "auto" && supported);
}

// An uninitialised tensor whose whole 2 MB pages the kernel backs with huge pages when first written
// (where transparent huge pages are enabled "on madvise"). KDA's outputs and kept states are large and
// fresh, and faulting them in by 4 kB pages costs 3x as long as by 2 MB ones (~35 vs ~10 ms for 134 MB on
// the dev box), about as long as the forward itself at T = 4096; weights tiled for decode are read by 2 MB
// pages a few % faster than by 4 kB ones (fewer TLB misses on a stream of 10 GB).
inline torch::Tensor empty_on_huge_pages(torch::IntArrayRef sizes, const torch::TensorOptions& options) {
  auto t = torch::empty(sizes, options);
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = (begin + t.nbytes()) & ~(kHuge - 1);
#ifdef MADV_HUGEPAGE
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
  return t;
}

// fn(t) for every task t in [0, n), each task a chunk of its own, taken by the threads as they go (tasks of
// different kinds in one region, a core's arithmetic beside a stream from memory: moe_experts); alone, in order,
// on one thread or inside a region already.
template <typename F>
inline void parallel_tasks(int64_t n, const F& fn) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || n <= 1 || at::in_parallel_region() || !ChunkPool::with_threads(threads).run(n, fn))
    for (int64_t t = 0; t < n; ++t) fn(t);
}

// fn(lo, hi) over [0, n) in chunks that each of as many threads as torch uses takes as it finishes the one
// before, instead of one even share each, on a ChunkPool's threads (_native_pool.h), whose regions wait only
// for the chunks a thread took: where another process shares a core, the thread on it does less of the work
// rather than hold the others at the region's end (docs/native-cpus.md "A shared machine"). Chunks are
// multiples of `grain`; a loop is cut into up to four a thread where each still holds `least` items (the
// smallest piece worth handing out alone), else into one a thread, an even split. Which thread computes a chunk
// changes no bits: the kernels compute every output inside one call, in a fixed order.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t grain, int64_t least, const F& fn) {
  const int64_t threads = at::get_num_threads();
  if (n <= 0) return;
  if (threads <= 1 || n <= grain || at::in_parallel_region()) return fn(0, n);
  const int64_t wanted = std::clamp<int64_t>(n / std::max(least, grain), threads, 4 * threads);
  const int64_t chunk = ((n + wanted - 1) / wanted + grain - 1) / grain * grain;
  const int64_t chunks = (n + chunk - 1) / chunk;
  parallel_tasks(chunks, [&](int64_t c) { fn(c * chunk, std::min(n, (c + 1) * chunk)); });
}

}  // namespace k3_native

#define K3_NATIVE_COMMON(m)                                                                          \
  do {                                                                                               \
    (m).def("cpu_supported", &k3_native::cpu_supported, "whether this CPU has AVX2 and FMA");        \
    (m).def("cpu_features", &k3_native::cpu_features, "{feature: bool} detected at run time");      \
    (m).attr("source_hash") = K3_STRINGIFY_VALUE(K3_NATIVE_SOURCE_HASH);                            \
  } while (0)
