// Weight layouts of the decode kernels, made once at load and undone for a prefill (k3/model/tiling.py): a BF16
// matrix tiled ([N/8, K/8, 8, 8]: tile_rows) or paired for bf16 products ([N/16, K/2, 16, 2]: _native_paired.h
// `pair_rows`), its rows taken back (rows_from_blocks), and matrices copied onto huge pages (on_huge_pages).
//
// Included by _native.cpp after _native_gemv.h (Tiled, load8).
#pragma once

#include <torch/extension.h>

#include "_native_common.h"
#include "_native_gemv.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace decode_native {

// w [N, K] BF16 in the Tiled layout: [N/8, K/8, 8, 8] (block, column step, row in block, column), on huge pages.
inline Tensor tile_rows(const Tensor& w) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.device().is_cpu() &&
                  w.size(0) % Tiled::kRows == 0 && w.size(1) % 8 == 0,
              "only a bfloat16 [N, K] CPU matrix with N and K multiples of 8 is tiled, got ", w.sizes(), " ",
              w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1);
  Tensor tiled = k3_native::empty_on_huge_pages({N / Tiled::kRows, K / 8, Tiled::kRows, 8}, w.options());
  const Tensor rows = w.contiguous();
  const auto* from = static_cast<const uint16_t*>(rows.data_ptr());
  auto* to = static_cast<uint16_t*>(tiled.data_ptr());
  at::parallel_for(0, N / Tiled::kRows, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t n = b0 * Tiled::kRows; n < b1 * Tiled::kRows; ++n)
      for (int64_t i = 0; i < K; i += 8) std::memcpy(Tiled::start(to, K, n) + i * Tiled::kStep, from + n * K + i, 16);
  });
  return tiled;
}

// Copies of these tensors packed into one allocation on huge pages where the OS allows (a decode step
// streams every weight once, and on 4 kB pages it misses the TLB every 4 kB), each 64-byte aligned and a
// tensor with a storage of its own (the allocation lives while any of them does), so that nothing looks
// shared to a state_dict's savers. k3.model.tiling.
inline std::vector<Tensor> on_huge_pages(const std::vector<Tensor>& tensors) {
  constexpr int64_t kAlign = 64, kHuge = int64_t{1} << 21;
  const auto slot = [](int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; };
  int64_t total = 0;
  for (const Tensor& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "only contiguous CPU tensors are placed, got ", t.sizes());
    total += slot(t.nbytes());
  }
  // whole huge pages from the first 2 MB boundary on: one page more than the slots need, rounded up
  const int64_t bytes = (total + 2 * kHuge - 1) / kHuge * kHuge;
  const Tensor arena = k3_native::empty_on_huge_pages({bytes}, torch::TensorOptions().dtype(torch::kUInt8));
  auto* base = static_cast<uint8_t*>(arena.data_ptr());
  int64_t at = static_cast<int64_t>((kHuge - reinterpret_cast<uintptr_t>(base) % kHuge) % kHuge);
  std::vector<Tensor> placed;
  for (const Tensor& t : tensors) {
    Tensor copy = torch::from_blob(base + at, t.sizes(), [arena](void*) {}, t.options());
    copy.copy_(t);
    placed.push_back(copy);
    at += slot(t.nbytes());
  }
  return placed;
}

// A block's R rows ([K/C, R, C] at `from`) as float32 rows of K values at `to` (each exact: a BF16 value is
// the high half of its float), one row at a time. A function of its own compiled for AVX2, so that the
// conversion is inlined into its loop (called from the parallel region's lambda, it was not: 2.5-2.7x
// slower).
__attribute__((target("avx2,fma"))) inline void block_to_floats(const uint16_t* from, int64_t steps, int64_t R,
                                                                int64_t C, float* to) {
  const int64_t K = steps * C;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t s = 0; s < steps; ++s) {
      const uint16_t* piece = from + (s * R + r) * C;  // row r, columns sC .. sC + C - 1
      float* row = to + r * K + s * C;
      if (C == 8) {
        _mm256_storeu_ps(row, load8(piece));
      } else {
        for (int64_t c = 0; c < C; ++c) row[c] = to_float(piece[c]);
      }
    }
}

// Rows [start, stop) of a BF16 matrix laid out in blocks of R rows ([N/R, K/C, R, C]: tiled, R = C = 8, or
// paired, R = 16, C = 2) written back in rows into out [stop - start, K], float32 (every value exact) or
// bfloat16 (copied): what a prefill's GEMM multiplies (k3.model.tiling.rows_of). Each block (R K values,
// 115 kB tiled at K = 7168: it stays in L2) is written out one row at a time, so the writes run in order.
// 292 rows of a tiled [7168, 7168] at 2 / 1 threads: 0.25 / 0.33 ms, as fast as torch's copy of the same
// rows stored row-major (0.18-0.25 / 0.26-0.35); torch's copy from the blocks' transposed view, which
// moves 16 bytes per inner loop, 0.65-0.93 / 1.14-1.30 ms; their GEMM with 293 tokens 7.2-7.3 / 13.5-13.6
// ms (AVX2-only EPYC, Zen 3).
inline Tensor rows_from_blocks(const Tensor& w, int64_t start, int64_t stop, Tensor out) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 4 && w.is_contiguous() && w.device().is_cpu(),
              "w must be a contiguous bfloat16 CPU matrix in blocks [N/R, K/C, R, C], got ", w.sizes(), " ",
              w.scalar_type());
  const int64_t R = w.size(2), C = w.size(3), steps = w.size(1), N = w.size(0) * R, K = steps * C;
  TORCH_CHECK(0 <= start && start <= stop && stop <= N && start % R == 0 && stop % R == 0,
              "the rows of a matrix in blocks of ", R, " rows are taken in whole blocks from [0, ", N, "), got [",
              start, ", ", stop, ")");
  const bool to_fp32 = out.scalar_type() == torch::kFloat32;
  TORCH_CHECK((to_fp32 || out.scalar_type() == torch::kBFloat16) && out.is_contiguous() && out.device().is_cpu() &&
                  out.dim() == 2 && out.size(0) == stop - start && out.size(1) == K,
              "out must be a contiguous float32 or bfloat16 CPU matrix [", stop - start, ", ", K, "], got ",
              out.sizes(), " ", out.scalar_type());
  const auto* from = static_cast<const uint16_t*>(w.data_ptr());
  float* to_float32 = to_fp32 ? out.data_ptr<float>() : nullptr;
  auto* to_bf16 = to_fp32 ? nullptr : static_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(start / R, stop / R, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* block = from + b * steps * R * C;
      const int64_t first = (b * R - start) * K;  // where the block's first row goes
      if (to_fp32) {
        block_to_floats(block, steps, R, C, to_float32 + first);
        continue;
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t s = 0; s < steps; ++s)
          std::memcpy(to_bf16 + first + r * K + s * C, block + (s * R + r) * C, C * sizeof(uint16_t));
    }
  });
  return out;
}

}  // namespace decode_native
