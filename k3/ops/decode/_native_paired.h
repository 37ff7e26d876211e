// BF16 weights times vectors rounded to bfloat16, with bf16 dot products (AVX-512 BF16: vdpbf16ps): the
// decode step's opted-in "bf16 products" (k3.model.tiling, `tile_weights(bf16_products=True)`).
//
// A step of several sequences multiplies every BF16 matrix by several vectors: compute-bound, not memory-
// bound. The exact kernels (_native_gemv.h) convert each weight to fp32 and spend one 16-lane FMA per 16
// products; vdpbf16ps does 32 products an instruction and needs no conversion, at the cost of rounding the
// vectors (the activations) to bfloat16 first, round to nearest even. The sums stay fp32.
//
// Layout ("paired"): blocks of 16 rows stored [K/2][16 rows][2 columns], so that one 64-byte line holds
// the next two columns of all 16 rows, lane r the pair of row r, as vdpbf16ps pairs them with a vector's
// two values broadcast to every lane. A block is one memory stream read front to back; each lane of an
// accumulator is one row's sum over the pairs in order, and the 16 lanes are the block's 16 outputs (no
// horizontal sums). A row's value therefore depends on nothing but its weights and its vector: not the
// batch, the thread count, the rows beside it nor the tile that computed it. It may differ between CPU
// makers: how vdpbf16ps rounds inside its pair of products is the vendor's.
//
// Nothing is asked for ahead: each block is one stream of whole 64-byte lines, which the hardware prefetcher
// follows by itself. Asking for each block's line 8 kB ahead at every step (as the tiled kernels do) was
// slower: k3-slice decode steps with int8 experts, builds alternated step by step in one process, EPYC Zen 4,
// one thread one sequence 287.6 against 328.3 ms (median of 8; 339.1 against 385.2 in a second run), eight
// sequences 510.8 against 525.2; two threads 248.5 against 253.2 and 316.8 against 330.2.
#pragma once

#include <torch/extension.h>

#include "_native_common.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "mxfp4/_native_bf16.h"

namespace decode_paired {

constexpr int64_t kRows = 16;         // rows per block: one 16-lane accumulator
constexpr int64_t kColumns = 2;       // columns per step: one pair per lane
constexpr int64_t kMaxVectors = 8;    // vectors per pass: 2 blocks x 8 accumulators + 2 weights + 1 vector

#define K3_PAIRED __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

inline bool supported() { return mxfp4_bf16::cpu_supported(); }

// x [B, K] fp32 rounded to bfloat16, round to nearest even (NaN stays NaN), into `out` [B, K]
K3_PAIRED inline void round_vectors(const float* x, int64_t B, int64_t K, std::vector<uint16_t>& out) {
  out.resize(static_cast<size_t>(B * K));
  const int64_t n = B * K;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + i));
    _mm256_mask_storeu_epi16(out.data() + i, mask, rounded);
  }
}

// y[b * ldy + n] for the R blocks from row n (lanes outside `keep[r]` not stored) and the vectors b0 ..
// b0 + V - 1: each block's line loaded once per step for the V vectors.
template <int R, int V>
K3_PAIRED void blocks_times_vectors(const uint16_t* W, int64_t K, const uint16_t* x, int64_t b0, float* y,
                                    int64_t ldy, int64_t n, const __mmask16* keep) {
  const uint16_t* block[R];
  for (int r = 0; r < R; ++r) block[r] = W + (n + r * kRows) * K;  // [K/2][16][2]
  __m512 acc[R][V];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < K; i += kColumns) {
    __m512bh w[R];
    for (int r = 0; r < R; ++r) w[r] = (__m512bh)_mm512_loadu_si512(block[r] + i * kRows);
    for (int v = 0; v < V; ++v) {
      int32_t pair;
      std::memcpy(&pair, x + (b0 + v) * K + i, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int r = 0; r < R; ++r) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w[r], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_mask_storeu_ps(y + (b0 + v) * ldy + n + r * kRows, keep[r], acc[r][v]);
}

using Pass = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t,
                      const __mmask16*);

template <int R>
Pass pass_of(int64_t V) {
  constexpr Pass kPasses[] = {nullptr,
                              blocks_times_vectors<R, 1>,
                              blocks_times_vectors<R, 2>,
                              blocks_times_vectors<R, 3>,
                              blocks_times_vectors<R, 4>,
                              blocks_times_vectors<R, 5>,
                              blocks_times_vectors<R, 6>,
                              blocks_times_vectors<R, 7>,
                              blocks_times_vectors<R, 8>};
  return kPasses[V];
}

// The lanes of the block from row m that lie in [n0, n1)
inline __mmask16 lanes_in(int64_t m, int64_t n0, int64_t n1) {
  const int64_t lo = std::clamp<int64_t>(n0 - m, 0, kRows), hi = std::clamp<int64_t>(n1 - m, 0, kRows);
  return __mmask16(((1u << hi) - 1) & ~((1u << lo) - 1));
}

// y[b * ldy + n] = W[n, :] . round_bf16(x[b]) for b < B and rows n in [n0, n1) of a paired matrix W: the
// blocks that hold those rows (a block split between two ranges is computed whole by both, each storing its
// own lanes), one vector four blocks at a time (four streams in flight), several two blocks x up to eight
// vectors (the second pass of more than eight reads the blocks from the L2 cache).
K3_PAIRED inline void paired_rows(const uint16_t* W, int64_t K, const float* x, int64_t B, float* y, int64_t ldy,
                                  int64_t n0, int64_t n1) {
  thread_local std::vector<uint16_t> rounded;
  round_vectors(x, B, K, rounded);
  const int64_t R = B == 1 ? 4 : 2;
  const int64_t first = n0 / kRows * kRows;
  for (int64_t m = first; m < n1; m += R * kRows) {
    const int64_t blocks = std::min<int64_t>(R, (n1 - m + kRows - 1) / kRows);
    __mmask16 keep[4];
    for (int64_t r = 0; r < blocks; ++r) keep[r] = lanes_in(m + r * kRows, n0, n1);
    if (blocks == 4) {  // one vector
      blocks_times_vectors<4, 1>(W, K, rounded.data(), 0, y, ldy, m, keep);
      continue;
    }
    for (int64_t b = 0; b < B; b += kMaxVectors) {
      const int64_t V = std::min(kMaxVectors, B - b);
      (blocks >= 2 ? pass_of<2>(V) : pass_of<1>(V))(W, K, rounded.data(), b, y, ldy, m, keep);
      if (blocks == 3) pass_of<1>(V)(W, K, rounded.data(), b, y, ldy, m + 2 * kRows, keep + 2);
    }
  }
}

// w [N, K] BF16 in the paired layout [N/16, K/2, 16, 2], on huge pages.
inline torch::Tensor pair_rows(const torch::Tensor& w) {
  TORCH_CHECK(supported(), "bf16 products need a CPU with AVX-512 BF16 (avx512_bf16); this one has none");
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.device().is_cpu() && w.size(0) % kRows == 0 &&
                  w.size(1) % kColumns == 0,
              "only a bfloat16 [N, K] CPU matrix with N a multiple of 16 and K of 2 is paired, got ", w.sizes(), " ",
              w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1);
  torch::Tensor paired = k3_native::empty_on_huge_pages({N / kRows, K / kColumns, kRows, kColumns}, w.options());
  const torch::Tensor rows = w.contiguous();
  const auto* from = static_cast<const uint32_t*>(rows.data_ptr());  // a pair of bf16 values per element
  auto* to = static_cast<uint32_t*>(paired.data_ptr());
  at::parallel_for(0, N / kRows, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t n = b0 * kRows; n < b1 * kRows; ++n)
      for (int64_t i = 0; i < K / kColumns; ++i)
        to[(n / kRows * (K / kColumns) + i) * kRows + n % kRows] = from[n * (K / kColumns) + i];
  });
  return paired;
}

#undef K3_PAIRED

}  // namespace decode_paired
