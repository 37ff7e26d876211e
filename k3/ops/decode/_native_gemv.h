// What the fused decode-layer kernels (_native.cpp) are built from: weight matrices times a few vectors,
// several matrices in one parallel region, and the small elementwise functions of a decoder layer.
//
// A decode step multiplies every weight matrix of the model by one vector per sequence: memory-bound work
// that torch dispatches as hundreds of small `mm` calls. Here all the matrices that read the same input
// (a KDA layer's q, k, v, f_a, beta and gate projections, say) share one `at::parallel_for` over their
// rows, so a second thread halves the time of each group instead of waiting on tiny ops.
#pragma once

#include <torch/extension.h>

#include "_native_common.h"
#include "_native_math.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "mxfp4/_native_int8.h"
#include "mxfp4/_native_rows.h"
#include "mxfp4/_native_rows512.h"
#include "_native_paired.h"

namespace decode_native {

using Tensor = torch::Tensor;
using Optional = std::optional<Tensor>;
using Buffer = std::vector<float>;  // a kernel's scratch (no aten op, unlike a Tensor)

constexpr int64_t kRowBlock = 16;  // weight rows kept in cache while every vector of the batch reads them

__attribute__((target("avx2,fma"))) inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return mxfp4_rows::horizontal_sum(acc) + tail;
}

// Weights are fp32, or BF16 read as fp32 in registers: a BF16 value is the high half of its float, so the
// conversion is exact and the arithmetic is fp32's; only 2 bytes a weight cross the memory bus.
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// sum_{i in [from, K)} a[i] b[i] in order: the tails of `dot`, `tile` and `tile_pairs` beyond their 8-lane body, in
// one compiled copy (inlined into an AVX-512 function the compiler could contract it otherwise: other bits)
template <typename T>
__attribute__((target("avx2,fma"), noinline)) float tail_dot(const T* a, const float* b, int64_t from, int64_t K) {
  float tail = 0.0f;
  for (int64_t i = from; i < K; ++i) tail += to_float(a[i]) * b[i];
  return tail;
}

// Where row n's weights lie, 8 columns at a time: row n's values i .. i + 7 (i a multiple of 8) start at
// `start(W, K, n) + i * kStep`, and row n + r's at r * rows_apart(K) from row n's (for the rows of one tile;
// tiled, they must share a block).
//   RowMajor  [N, K] as stored: row n at W + n K.
//   Tiled     BF16 weights re-laid once at load (k3.model.tiling): blocks of 8 rows stored [K/8][8 rows][8],
//             so the 8 rows a one-vector tile reads are one memory stream, not 8 (one vector times [4096,
//             7168] matrices cycled, rows and tiles alternated, EPYC Zen 5: 1.18-1.28x the GB/s of rows at 2
//             threads, 1.04-1.19x at 1). Needs N and K multiples of 8 (checked by dense_weight).
struct RowMajor {
  static constexpr int64_t kStep = 1;
  template <typename T>
  static T* start(T* W, int64_t K, int64_t n) { return W + n * K; }
  static int64_t rows_apart(int64_t K) { return K; }
};
struct Tiled {
  static constexpr int64_t kStep = 8;
  static constexpr int64_t kRows = 8;  // rows per block
  template <typename T>
  static T* start(T* W, int64_t K, int64_t n) { return W + (n / kRows) * kRows * K + (n % kRows) * 8; }
  static int64_t rows_apart(int64_t) { return 8; }
};

// BF16 rows: the line kPrefetchBytes ahead of row[i] is asked for once per line. A tile's R rows are R
// memory streams that each advance only 16 bytes per 8-lane step; the hardware prefetcher alone kept them
// short of the read bandwidth (EPYC Zen 5, [4096, 7168], rows in the same run without / with: one thread
// B = 1 22-24 -> 27-29 GB/s, B = 8 122-128 -> 170 GFLOP/s; two threads B = 1 level at 36-38 GB/s, B = 8
// 230 -> 287-297 GFLOP/s). fp32 rows advance twice as fast and lost from it at two threads: not asked.
// A tiled block is one stream of 128 bytes a step: its two lines kTiledAhead bytes ahead are asked for at
// every step (the same matrices cycled, 2 threads, tiled against rows: B = 1 69-70 GB/s without the ask
// 64, rows 56-57; B = 4 at 512 / 2,048 / 4,096 / 8,192 / 16,384 bytes ahead 27 / 37-40 / 45-52 / 62-65 /
// 55-58 GB/s, rows 39-49: the many products a step of several vectors does leave the core too few loads
// in flight to keep the stream going by itself). A prefetch never faults, so asking past a matrix's end
// is harmless (the address is computed as an integer).
constexpr int64_t kPrefetchBytes = 1024;
constexpr int64_t kTiledAhead = 8192;
// Short rows: a one-vector tile of 8 rows of at most kShortTileBytes (fp32 at K <= 512, `mini`'s and Kimi
// Linear's widths) is one block of memory read as 8 streams that each end after a few lines, too soon for
// the hardware prefetcher: `tile` asks for the next tile's block in address order while it sums its own
// (`mini`'s fp32 matrices, without and with in one process, EPYC Zen 4: one thread [32768, 512] 13.4 -> 15.3
// GB/s, [1536, 512] 17.5 -> 23.3, [256, 512] 18.2 -> 26.4; two threads level to 1.2x; a decode step of `mini`
// 12.9-14.9 -> 10.9-13.4 ms at one thread). Asking for whole next tiles of 32 and 48 kB ([1024, 1024], [512,
// 1536]) lost 4-20 %: they no longer fit in the L1 cache beside the tile being read.
// Rows and short tiles ask for their lines into the L2 cache (prefetcht1), tiled blocks into L1: rows and
// blocks cycled with the caches flushed before each pass, one process, T0 against T1, EPYC Zen 4: BF16
// rows [4096, 7168] one thread 14.9-15.3 -> 20.1-20.3 GB/s, two 26.0-26.4 -> 32.0-32.2; `mini`'s fp32
// [32768, 512] 16.0 -> 23.5 and 27.5 -> 34.3, [512, 512] 16.5 -> 24.2 and 22.3 -> 34.1; tiled BF16 blocks
// 21.4-22.2 -> 19.6-20.5 and 38.0-43.4 -> 39.1-39.2, so they keep T0. Not measured on other CPUs.
constexpr int64_t kShortTileBytes = 16384;

// How a short tile is read on Zen 3. Asking for the next tile's block ahead, measured on Zen 4 (`mini`'s steps
// 12.9-14.9 -> 10.9-13.4 ms at one thread, above), cost 5-10 % there: `mini`'s fp32 matrices cycled read at
// 16.2-16.3 GB/s against 17.1-18.0 left to the hardware prefetcher at one thread, 25.3 against 26.4 at two
// (2026-12-05), so Zen 3 (k3_native::cpu_is_zen3) never asks for a next tile. And it reads short fp32 rows one
// row at a time (a tile<1, V> each, asking kShortRowAhead bytes ahead into L1 once a line:
// read_short_rows_one_by_one): eight short streams at once, each over in a few lines, left its prefetcher
// untrained, where one row after the other is one stream through the matrix. fp32 [N, K] matrices of 240 MB
// cycled on huge pages, one thread, a C++ loop of the two orders (1 kB ahead; 2026-12-05): K = 256 9.5-10.2 ->
// 19.0-21.0 GB/s, K = 512 15.1-16.2 -> 19.6-21.5 ([32768, 512]: 14.6-15.0 -> 19.5-20.4); longer rows read faster
// in tiles (K = 1536 21.6-23.3 against 21.3-22.1, K = 7168 ~25 against ~20), so only short rows change. A `mini`
// step after 512 tokens (one process per setting, settings in turn, 4 rounds, medians of 300 steps): one thread
// 8.72-9.92 ms in tiles, 8.03-8.47 one by one asking 2 kB ahead (4 kB 8.13-8.99, none 8.87-9.28); two threads
// 5.79-6.32 against 5.46-6.15. One chain of FMAs a row computes at most ~35 GB/s from the L2 cache (tiles of 8:
// ~47), above what memory gives one core. The same bits either way: a row's value is one 8-lane accumulator over
// i in order whatever the tile. Several vectors read each such row once for up to 8 of them (tile<1, 8>: 8
// accumulators), not tiles of 6 rows x 2 vectors read four times: 8 vectors x [32768, 512] from memory 30-34 ->
// 42-45 GFLOP/s (from L2 48 -> 39), a `mini` step of 8 sequences 22.6-28.4 -> 20.4-22.0 ms at one thread
// (processes alternated, 3 rounds, medians of 60 steps). Measured on Zen 3 only; BF16 rows (tiled at load) keep
// their tiles.
constexpr int64_t kShortRowAhead = 2048;
// Up to this many vectors read short rows one by one; more read tiles, whose loads of each vector serve six
// rows (B vectors times twelve [4096, 512] matrices cycled, one thread, GFLOP/s in tiles against one by one:
// B = 8 34-36 / 46-48, 12 41.0 / 46.6, 16 47.7-48.7 / 45.0-45.1, 32 58.1 / 40.6, 64 65.5 / 41.5).
constexpr int64_t kRowByRowVectors = 12;
inline bool ask_short_tiles_ahead() { return !k3_native::cpu_is_zen3(); }
inline bool read_short_rows_one_by_one() { return k3_native::cpu_is_zen3(); }

// Whether a tiled block read for one vector asks for its lines kTiledAhead bytes ahead (several vectors
// always do). On Zen 4 the ask slowed it: cycled tiled [4096, 7168] matrices in a C++ loop, one vector, one
// process, the two alternated, 1 / 2 threads 24.9-25.1 against 28.4-28.5 GB/s without / 31.3-32.8 against
// 33.1-34.2; whole `k3-slice` decode steps alternated step by step in one process (a scratch build's switch,
// 20 pairs): 1 thread 424.5 -> 371.2 ms (medians; faster in 19 of 20), 2 threads 287.3 -> 267.2 (18 of 20;
// AMD EPYC Zen 4 VM, 2026-12-08). On Zen 5 it helped (69-70 against 64 GB/s, 2026-12-03): every other CPU
// keeps it. The MXFP4 one-row kernel's ask (_native_rows512.h) is another matter: switched off the same way on
// Zen 4, 44 K3 experts cycled ran 0.556 against 0.312 ms a matrix at 2 threads, 1.060 against 0.573 at 1.
inline bool ask_tiled_rows_ahead() { return !k3_native::cpu_is_zen4(); }

template <typename T>
inline void prefetch_at(const T* p, int64_t bytes) {  // into the L1 cache
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + bytes));
}

template <typename T>
inline void prefetch_to_l2(const T* p, int64_t bytes) {  // prefetcht1
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + bytes), 0, 2);
}

// `row` is a tile's first row (tiled: where its block's step i starts, to within a line)
template <typename L, typename T>
inline void prefetch_ahead(const T* row, int64_t i) {
  if constexpr (std::is_same_v<L, Tiled>) {
    prefetch_at(row + i * Tiled::kStep, kTiledAhead);
    prefetch_at(row + i * Tiled::kStep, kTiledAhead + 64);
  } else if constexpr (std::is_same_v<T, uint16_t>) {
    if (i % 32 == 0) prefetch_to_l2(row + i, kPrefetchBytes);  // one 64-byte line per 4 steps of 8
  }
}

// y[b * ldy + n] for n in [n, n + R) and the vectors b in [b0, b0 + V): a tile of R rows x V vectors, each
// weight loaded (and converted) once for the V vectors and each vector once for the R rows. Every value is
// one accumulator of 8 lanes over i in order, then their sum and the tail: the same arithmetic whatever the
// tile and the layout L, so a row's result depends on neither the size of its batch nor how it is stored.
// `row_ahead`: a row read alone asks for its own line kShortRowAhead bytes ahead (read_short_rows_one_by_one).
template <int R, int V, typename L, typename T>
__attribute__((target("avx2,fma"))) inline void tile(const T* W, int64_t K, const float* x, int64_t b0, float* y,
                                                     int64_t ldy, int64_t n, bool row_ahead = false) {
  const int64_t body = K - K % 8;  // K itself when tiled
  const T* r0 = L::start(W, K, n);
  const int64_t apart = L::rows_apart(K);
  __m256 acc[R][V];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  // Short rows (one vector, the tile's R rows one block of at most kShortTileBytes): the next tile's block is
  // asked for in address order, R * 8 values a step, so that it arrives while this one is summed (not on Zen 3:
  // ask_short_tiles_ahead).
  constexpr int64_t kStepBytes = R * 8 * sizeof(T);
  const bool short_rows = std::is_same_v<L, RowMajor> && V == 1 && R * K * int64_t(sizeof(T)) <= kShortTileBytes;
  const bool ask_next_tile = short_rows && !row_ahead && ask_short_tiles_ahead();
  for (int64_t i = 0; i < body; i += 8) {
    __m256 xv[V];
    for (int v = 0; v < V; ++v) xv[v] = _mm256_loadu_ps(x + (b0 + v) * K + i);
    if constexpr (std::is_same_v<L, Tiled>) prefetch_ahead<L>(r0, i);
    if (ask_next_tile)
      for (int64_t line = 0; line < kStepBytes; line += 64) prefetch_to_l2(r0 + R * K, i / 8 * kStepBytes + line);
    if (row_ahead && i * int64_t(sizeof(T)) % 64 == 0) prefetch_at(r0 + i, kShortRowAhead);
    for (int r = 0; r < R; ++r) {
      if constexpr (std::is_same_v<L, RowMajor>)
        if (!short_rows) prefetch_ahead<L>(r0 + r * apart, i);
      const __m256 w = load8(r0 + r * apart + i * L::kStep);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(w, xv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      const float tail = body < K ? tail_dot(r0 + r * apart, x + (b0 + v) * K, body, K) : 0.0f;
      y[(b0 + v) * ldy + n + r] = mxfp4_rows::horizontal_sum(acc[r][v]) + tail;
    }
}

#define K3_DECODE_AVX512 __attribute__((target("avx2,fma,avx512f,avx512dq")))

// 8 weights as fp32 in both 256-bit halves of a 16-lane register
K3_DECODE_AVX512 inline __m512 load8_twice(const float* p) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(p)); }
K3_DECODE_AVX512 inline __m512 load8_twice(const uint16_t* p) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(both), 16));
}

// `tile` for R rows x 2P vectors in 16 lanes: register (r, p) holds the 8-lane accumulators of vectors
// b0 + 2p (lanes 0-7) and b0 + 2p + 1 (lanes 8-15), each lane doing what its AVX2 lane does, in the same
// order, so every value has `tile`'s bits. A weight is loaded and converted once for 2P vectors. Rows as
// stored ([N, K]); tiled weights have their own blocks (tiled_block).
template <int R, int P, typename T>
K3_DECODE_AVX512 inline void tile_pairs(const T* W, int64_t K, const float* x, int64_t b0, float* y, int64_t ldy,
                                        int64_t n) {
  const int64_t body = K - K % 8;
  const T* r0 = RowMajor::start(W, K, n);
  const int64_t apart = RowMajor::rows_apart(K);
  __m512 acc[R][P];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < body; i += 8) {
    __m512 xv[P];
    for (int p = 0; p < P; ++p) {
      const float* xp = x + (b0 + 2 * p) * K + i;
      xv[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(xp)), _mm256_loadu_ps(xp + K), 1);
    }
    for (int r = 0; r < R; ++r) {
      prefetch_ahead<RowMajor>(r0 + r * apart, i);
      const __m512 w = load8_twice(r0 + r * apart + i);
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(w, xv[p], acc[r][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < 2; ++h) {
        const float tail = body < K ? tail_dot(r0 + r * apart, x + (b0 + 2 * p + h) * K, body, K) : 0.0f;
        const __m256 half = h ? _mm512_extractf32x8_ps(acc[r][p], 1) : _mm512_castps512_ps256(acc[r][p]);
        y[(b0 + 2 * p + h) * ldy + n + r] = mxfp4_rows::horizontal_sum(half) + tail;
      }
}

// Rows [n0, n1) for B >= 2 vectors with tile_pairs: six rows x up to eight vectors (24 accumulators, 4 vector
// pairs and a weight: 29 of the 32 registers); an odd last vector and the last rows as dense_rows does them.
template <typename T>
K3_DECODE_AVX512 inline int64_t dense_rows_pairs(const T* W, int64_t K, const float* x, int64_t B, float* y,
                                                 int64_t ldy, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 6 <= n1; n += 6) {
    int64_t b = 0;
    for (; b + 8 <= B; b += 8) tile_pairs<6, 4>(W, K, x, b, y, ldy, n);
    for (; b + 4 <= B; b += 4) tile_pairs<6, 2>(W, K, x, b, y, ldy, n);
    for (; b + 2 <= B; b += 2) tile_pairs<6, 1>(W, K, x, b, y, ldy, n);
    if (b < B) tile<6, 1, RowMajor>(W, K, x, b, y, ldy, n);
  }
  return n;
}

// y[b * ldy + n] = W[n, :] . x[b] for b < B, n in [n0, n1), each group of rows read from memory once for all B
// vectors. One vector: eight rows at a time (eight memory streams in flight; measured at K3's KDA projections, 2
// threads: 33 GB/s against 28 with four), or short fp32 rows one at a time where `one_by_one`
// (Weight::short_rows_one_by_one: Zen 3; up to kRowByRowVectors vectors). Several: six rows x two vectors per
// tile (12 accumulators, 2 vectors and a weight: 15 of the 16 AVX2 registers), each vector read once per six rows
// from the cache: at B = 8, 125 GFLOP/s against 100-118 with four rows x two vectors or two x four. With `wide`
// (AVX-512), dense_rows_pairs' six rows x eight vectors first: at a [4096, 7168] matrix, 2 threads, B = 8, BF16
// 200 GFLOP/s against 133 (fp32 150 against 107), B = 2-3 level (memory-bound).
template <typename T>
__attribute__((target("avx2,fma"))) inline void dense_rows(const T* W, int64_t K, const float* x, int64_t B,
                                                           float* y, int64_t ldy, int64_t n0, int64_t n1,
                                                           bool wide = false, bool one_by_one = false) {
  const bool short_fp32 = std::is_same_v<T, float> && 8 * K * int64_t(sizeof(T)) <= kShortTileBytes;
  if (one_by_one && short_fp32 && B <= kRowByRowVectors) {
    for (int64_t n = n0; n < n1; ++n) {  // each row read for 8 vectors at a time (8 accumulators)
      int64_t b = 0;
      for (; b + 8 <= B; b += 8) tile<1, 8, RowMajor>(W, K, x, b, y, ldy, n, true);
      for (; b + 4 <= B; b += 4) tile<1, 4, RowMajor>(W, K, x, b, y, ldy, n, true);
      for (; b + 2 <= B; b += 2) tile<1, 2, RowMajor>(W, K, x, b, y, ldy, n, true);
      if (b < B) tile<1, 1, RowMajor>(W, K, x, b, y, ldy, n, true);
    }
    return;
  }
  const int64_t step = B == 1 ? 8 : 6;
  int64_t n = wide && B > 1 ? dense_rows_pairs(W, K, x, B, y, ldy, n0, n1) : n0;
  for (; n + step <= n1; n += step) {
    if (B == 1) {
      tile<8, 1, RowMajor>(W, K, x, 0, y, ldy, n);
      continue;
    }
    int64_t b = 0;
    for (; b + 2 <= B; b += 2) tile<6, 2, RowMajor>(W, K, x, b, y, ldy, n);
    if (b < B) tile<6, 1, RowMajor>(W, K, x, b, y, ldy, n);
  }
  for (; n < n1; ++n)
    for (int64_t b = 0; b < B; ++b) tile<1, 1, RowMajor>(W, K, x, b, y, ldy, n);
}

// V vectors b0 .. b0 + V - 1 times the tiled block of rows n .. n + 7 in 16 lanes: the block's rows 2j and
// 2j + 1 are 16 adjacent values per column step, one 32-byte load into one register whose halves do
// tile<8, 1>'s lanes for the two rows (a vector's 8 values in both halves), in its order: the same bits.
// 4 x V accumulators (V <= 6: 24, four weights and a vector: 29 of the 32 registers).
template <int V>
K3_DECODE_AVX512 inline void tiled_block(const uint16_t* W, int64_t K, const float* x, int64_t b0, float* y,
                                         int64_t ldy, int64_t n) {
  constexpr int64_t kPairs = Tiled::kRows / 2;
  const uint16_t* block = Tiled::start(W, K, n);  // [K/8][8 rows][8]
  __m512 acc[kPairs][V];
  for (auto& pair : acc)
    for (auto& a : pair) a = _mm512_setzero_ps();
  const bool ask = V > 1 || ask_tiled_rows_ahead();
  for (int64_t i = 0; i < K; i += 8) {
    if (ask) prefetch_ahead<Tiled>(block, i);
    __m512 w[kPairs];
    for (int64_t j = 0; j < kPairs; ++j) {
      const __m256i two = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + i * Tiled::kRows + j * 16));
      w[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(two), 16));
    }
    for (int v = 0; v < V; ++v) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (b0 + v) * K + i));
      for (int64_t j = 0; j < kPairs; ++j) acc[j][v] = _mm512_fmadd_ps(w[j], xv, acc[j][v]);
    }
  }
  for (int64_t j = 0; j < kPairs; ++j)
    for (int v = 0; v < V; ++v) {
      y[(b0 + v) * ldy + n + 2 * j] = mxfp4_rows::horizontal_sum(_mm512_castps512_ps256(acc[j][v]));
      y[(b0 + v) * ldy + n + 2 * j + 1] = mxfp4_rows::horizontal_sum(_mm512_extractf32x8_ps(acc[j][v], 1));
    }
}

// B vectors times the tiled block of rows n .. n + 7 in 16 lanes, six vectors per pass: the first pass
// streams the block (114 kB at K = 7168) from memory, the others read it from the L2 cache.
K3_DECODE_AVX512 inline void tiled_block_vectors(const uint16_t* W, int64_t K, const float* x, int64_t B, float* y,
                                                 int64_t ldy, int64_t n) {
  constexpr void (*kPass[])(const uint16_t*, int64_t, const float*, int64_t, float*, int64_t, int64_t) = {
      nullptr, tiled_block<1>, tiled_block<2>, tiled_block<3>, tiled_block<4>, tiled_block<5>, tiled_block<6>};
  for (int64_t b = 0; b < B; b += 6) kPass[std::min<int64_t>(6, B - b)](W, K, x, b, y, ldy, n);
}

// Rows n .. n + 15 (two consecutive tiled blocks) times one vector, the two blocks read side by side, each
// row's value as tile<8, 1, Tiled> gives it (one accumulator of 8 lanes over i in order: the same bits). One
// core reading one block at a time stopped short of memory's rate where two streams did not (AVX2-only
// EPYC Zen 3, 2 vCPUs, [N, 7168] matrices cycled on huge pages, alternated in one process, medians of 8:
// one thread 17.2-18.0 -> 21.8-22.5 GB/s, two 28.7-29.9 -> 32.3-33.0; asking for lines ahead, as `tile`
// does, changed neither).
__attribute__((target("avx2,fma"))) inline void tiled_block_pair(const uint16_t* W, int64_t K, const float* x,
                                                                 float* y, int64_t n) {
  constexpr int kRows = static_cast<int>(Tiled::kRows);
  const uint16_t* blocks[2] = {Tiled::start(W, K, n), Tiled::start(W, K, n + kRows)};
  __m256 acc[2][kRows];
  for (auto& block : acc)
    for (auto& a : block) a = _mm256_setzero_ps();
  for (int64_t i = 0; i < K; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int j = 0; j < 2; ++j)
      for (int r = 0; r < kRows; ++r)
        acc[j][r] = _mm256_fmadd_ps(load8(blocks[j] + i * Tiled::kStep + r * Tiled::rows_apart(K)), xv, acc[j][r]);
  }
  for (int j = 0; j < 2; ++j)
    for (int r = 0; r < kRows; ++r) y[n + j * kRows + r] = mxfp4_rows::horizontal_sum(acc[j][r]);
}

// A half block (rows `half` .. + 3 of a tiled block) times vectors b0 .. b0 + V - 1 over columns [i0, i1),
// carrying each row's and vector's 8-lane sum in `sums` ([B][4 rows][8 lanes], this half's): over all
// columns in order, tile<4, V, Tiled>'s arithmetic, so the same bits.
template <int V>
__attribute__((target("avx2,fma"))) inline void half_block_columns(const uint16_t* half, int64_t K, const float* x,
                                                                   int64_t b0, int64_t i0, int64_t i1,
                                                                   float* sums) {
  __m256 acc[4][V];
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_loadu_ps(sums + ((b0 + v) * 4 + r) * 8);
  for (int64_t i = i0; i < i1; i += 8) {
    __m256 xv[V];
    for (int v = 0; v < V; ++v) xv[v] = _mm256_loadu_ps(x + (b0 + v) * K + i);
    prefetch_ahead<Tiled>(half, i);
    for (int r = 0; r < 4; ++r) {
      const __m256 w = load8(half + r * Tiled::rows_apart(K) + i * Tiled::kStep);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(w, xv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(sums + ((b0 + v) * 4 + r) * 8, acc[r][v]);
}

// B > 1 vectors times the tiled block of rows n .. n + 7 (AVX2): K in chunks of kChunkColumns, each chunk's
// two halves x three or two vectors a pass (one vector's 4 chains of FMAs wait on their latency) while its
// 4 kB are in L1, the sums carried in `sums` (2 x [B][4][8]). The lines asked for ahead keep arriving while a
// chunk's later passes compute; reading each half block whole, pass after pass, left memory idle while the
// passes after the first read the L2 cache (docs/native-decode.md "Tiled BF16 weights").
constexpr int64_t kChunkColumns = 256;
__attribute__((target("avx2,fma"))) inline void tiled_block_chunks(const uint16_t* W, int64_t K, const float* x,
                                                                   int64_t B, float* y, int64_t ldy, int64_t n,
                                                                   float* sums) {
  std::fill(sums, sums + 2 * B * 32, 0.0f);
  for (int64_t i0 = 0; i0 < K; i0 += kChunkColumns) {
    const int64_t i1 = std::min(K, i0 + kChunkColumns);
    for (int h = 0; h < 2; ++h) {
      const uint16_t* half = Tiled::start(W, K, n + 4 * h);
      float* s = sums + h * B * 32;
      const int64_t passes = (B + 2) / 3;
      for (int64_t p = 0, b = 0; p < passes; ++p) {  // as even as can be: 4 = 2 + 2, not 3 + 1
        const int64_t V = (B - b + passes - p - 1) / (passes - p);
        if (V == 3) half_block_columns<3>(half, K, x, b, i0, i1, s);
        if (V == 2) half_block_columns<2>(half, K, x, b, i0, i1, s);
        b += V;
      }
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int64_t b = 0; b < B; ++b)
      for (int r = 0; r < 4; ++r)
        y[b * ldy + n + 4 * h + r] = mxfp4_rows::horizontal_sum(_mm256_loadu_ps(sums + ((h * B + b) * 4 + r) * 8));
}

// y[b * ldy + n] = W[n, :] . x[b] for tiled BF16 rows [n0, n1): whole blocks one at a time, each read front
// to back for all B vectors (a tile of 6 rows would straddle blocks and read most of them twice), the rows
// outside whole blocks one by one. Without AVX-512, one vector reads two blocks at a time (tiled_block_pair),
// and B > 1 each half block (4 rows: one cache line of the 128-byte column step) x three vectors per pass
// (12 accumulators, 3 vectors and a weight: the 16 AVX2 registers; with AVX2 forced here, against rows:
// 1.07-1.10x at B = 8, where two vectors per tile gave 0.91-0.94x) or two, a chunk of columns at a time
// (tiled_block_chunks); the other half's line from the cache.
__attribute__((target("avx2,fma"))) inline void tiled_rows(const uint16_t* W, int64_t K, const float* x, int64_t B,
                                                           float* y, int64_t ldy, int64_t n0, int64_t n1, bool wide) {
  constexpr int64_t kBlock = Tiled::kRows;
  const int64_t first = std::min(n1, (n0 + kBlock - 1) / kBlock * kBlock);
  const int64_t last = std::max(first, n1 / kBlock * kBlock);
  const auto one_by_one = [&](int64_t from, int64_t to) {
    for (int64_t n = from; n < to; ++n)
      for (int64_t b = 0; b < B; ++b) tile<1, 1, Tiled>(W, K, x, b, y, ldy, n);
  };
  one_by_one(n0, first);
  std::vector<float> sums(!wide && B > 1 ? 2 * B * 32 : 0);  // tiled_block_chunks
  for (int64_t n = first; n < last; n += kBlock) {
    if (wide) {
      tiled_block_vectors(W, K, x, B, y, ldy, n);
    } else if (B == 1 && n + 2 * kBlock <= last) {
      tiled_block_pair(W, K, x, y, n);
      n += kBlock;  // the pair's second block
    } else if (B == 1) {
      tile<8, 1, Tiled>(W, K, x, 0, y, ldy, n);
    } else {
      tiled_block_chunks(W, K, x, B, y, ldy, n, sums.data());
    }
  }
  one_by_one(last, n1);
}

// A [N, K] matrix: fp32 (`dense`), BF16 (`bf16`, row-major or `tiled`) or MXFP4 (`packed` [N, K/2] uint8 +
// `scale` [N, K/32] E8M0).
struct Weight {
  const float* dense = nullptr;
  const uint16_t* bf16 = nullptr;
  const uint8_t* packed = nullptr;
  const uint8_t* scale = nullptr;
  int64_t N = 0, K = 0;
  bool wide = false;   // the AVX-512 kernels, the same bits as the AVX2 ones: MXFP4 at any rows, dense at 2+,
                       // tiled BF16 at any
  bool tiled = false;  // bf16 in the Tiled layout
  bool paired = false; // bf16 in the paired layout: multiplied with bf16 products (_native_paired.h), opted into
  bool int8_x = false; // MXFP4 times x rounded to int8 per block (_native_int8.h): approximate, opted into
  bool short_rows_one_by_one = false;  // fp32 rows of <= 2 kB read row by row (the same bits)

  // y[b * ldy + n] = W[n, :] . x[b * K : (b + 1) * K] for b < B and n in [n0, n1).
  void rows(const float* x, int64_t B, float* y, int64_t ldy, int64_t n0, int64_t n1) const {
    if (dense != nullptr) return dense_rows(dense, K, x, B, y, ldy, n0, n1, wide, short_rows_one_by_one);
    if (bf16 != nullptr && paired) return decode_paired::paired_rows(bf16, K, x, B, y, ldy, n0, n1);
    if (bf16 != nullptr && tiled) return tiled_rows(bf16, K, x, B, y, ldy, n0, n1, wide);
    if (bf16 != nullptr) return dense_rows(bf16, K, x, B, y, ldy, n0, n1, wide);
    if (int8_x) {
      return mxfp4_int8::rows_product(x, B, packed, scale, K, y, ldy, n0, n1, wide && mxfp4_int8::vnni_here());
    }
    thread_local std::vector<float> storage;
    const mxfp4_rows512::LaidOut xd = mxfp4_rows512::lay_out(x, K, B, wide, storage);  // the kernels' order
    for (int64_t nb = n0; nb < n1; nb += kRowBlock) {
      const int64_t ne = std::min(n1, nb + kRowBlock);
      for (int64_t r0 = 0; r0 < B; r0 += mxfp4_rows::kMaxRows) {
        const int64_t r = std::min<int64_t>(mxfp4_rows::kMaxRows, B - r0);
        mxfp4_rows512::kernel(wide, B, r)(xd.data + r0 * xd.stride, xd.stride, packed, scale, K, y + r0 * ldy, ldy,
                                          nb, ne);
      }
    }
  }
};

inline void check_vector(const Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu() && t.numel() == n,
              name, " must be a contiguous float32 CPU tensor of ", n, " values, got ", t.sizes());
}

inline void check_rows(const Tensor& t, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu() && t.dim() >= 2 &&
                  t.numel() == rows * cols && t.size(-1) == cols,
              name, " must be a contiguous float32 CPU tensor of ", rows, " rows of ", cols, ", got ", t.sizes());
}

// N of a matrix [N, K], or of a tiled one [N/8, K/8, 8, 8] or a paired one [N/16, K/2, 16, 2]
inline int64_t matrix_rows(const Tensor& w) { return w.dim() == 4 ? w.size(0) * w.size(2) : w.size(0); }

// A float32 or BF16 [N, K] matrix, or a BF16 one tiled ([N/8, K/8, 8, 8]: the Tiled layout) or paired
// ([N/16, K/2, 16, 2]: bf16 products, _native_paired.h), both made by k3.model.tiling.
inline Weight dense_weight(const Tensor& w, int64_t K, const char* name) {
  const bool bf16 = w.scalar_type() == torch::kBFloat16;
  const auto laid_out = [&](int64_t rows, int64_t columns) {
    return bf16 && w.dim() == 4 && w.size(1) * columns == K && w.size(2) == rows && w.size(3) == columns;
  };
  const bool tiled = laid_out(Tiled::kRows, 8), paired = laid_out(decode_paired::kRows, decode_paired::kColumns);
  TORCH_CHECK((bf16 || w.scalar_type() == torch::kFloat32) && w.is_contiguous() && w.device().is_cpu() &&
                  ((w.dim() == 2 && w.size(1) == K) || tiled || paired),
              name, " must be a contiguous float32 or bfloat16 [N, ", K, "] CPU matrix, a tiled bfloat16 [N/8, ",
              K / 8, ", 8, 8] one or a paired one [N/16, ", K / 2, ", 16, 2], got ", w.sizes(), " ",
              w.scalar_type());
  TORCH_CHECK(!paired || decode_paired::supported(), name,
              " is paired for bf16 products, which need a CPU with AVX-512 BF16 (avx512_bf16)");
  const bool wide = mxfp4_rows512::gemv_variant() == "avx512";  // the CPU's best tiles (the same bits)
  const int64_t N = matrix_rows(w);
  if (bf16) return {nullptr, static_cast<const uint16_t*>(w.data_ptr()), nullptr, nullptr, N, K, wide, tiled, paired};
  Weight dense{w.data_ptr<float>(), nullptr, nullptr, nullptr, N, K, wide};
  dense.short_rows_one_by_one = read_short_rows_one_by_one();  // the CPU's faster order (the same bits)
  return dense;
}

inline Weight packed_weight(const Tensor& packed, const Tensor& scale, int64_t K, const char* name) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && scale.scalar_type() == torch::kUInt8 &&
                  packed.is_contiguous() && scale.is_contiguous() && packed.dim() == 2 && scale.dim() == 2 &&
                  K % mxfp4_rows::kBlock == 0 && packed.size(1) * 2 == K && scale.size(0) == packed.size(0) &&
                  scale.size(1) * mxfp4_rows::kBlock == K,
              name, " must be MXFP4 [N, ", K / 2, "] + scales [N, ", K / mxfp4_rows::kBlock, "], got ",
              packed.sizes(), " + ", scale.sizes());
  return {nullptr, nullptr, packed.data_ptr<uint8_t>(), scale.data_ptr<uint8_t>(), packed.size(0), K};
}

// y [B, W.N] = x [B, K] W^T for each job; x: the job's own input [B, W.K], or (null) the one project is given.
struct Job {
  Weight w;
  float* y;
  const float* x = nullptr;
};

// Rows [r0, r1) of the jobs' rows one after the other, on the calling thread.
inline void project_rows(const float* x, int64_t B, const std::vector<Job>& jobs, int64_t r0, int64_t r1) {
  int64_t base = 0;
  for (const Job& job : jobs) {
    const int64_t lo = std::max(r0, base), hi = std::min(r1, base + job.w.N);
    if (lo < hi) job.w.rows(job.x != nullptr ? job.x : x, B, job.y, job.w.N, lo - base, hi - base);
    base += job.w.N;
  }
}

inline int64_t rows_of_jobs(const std::vector<Job>& jobs) {
  int64_t total = 0;
  for (const Job& job : jobs) total += job.w.N;
  return total;
}

// The rows a chunk of `project` holds at least: ~128 KiB of fp32 weights at the first job's K.
inline int64_t project_grain(const std::vector<Job>& jobs) {
  return std::max<int64_t>(kRowBlock, 32768 / std::max<int64_t>(1, jobs.front().w.K));
}

// Every job's rows in one parallel region, taken by the threads in chunks as they go (k3_native::parallel_chunks):
// of at least ~128 KiB of fp32 weights, so that small groups are not split, and several a thread only from ~1 MiB
// a chunk (smaller ones, `mini`'s, cut each thread's stream of rows into pieces: 5 % slower steps).
inline void project(const float* x, int64_t B, const std::vector<Job>& jobs) {
  const int64_t grain = project_grain(jobs);
  k3_native::parallel_chunks(rows_of_jobs(jobs), grain, 8 * grain,
                             [&](int64_t r0, int64_t r1) { project_rows(x, B, jobs, r0, r1); });
}

// out = x / sqrt(mean(x^2) + eps) * w over n values (w null: no weight), as k3.model.norm.rms_norm.
inline void rms_norm(const float* x, const float* w, float eps, int64_t n, float* out) {
  float squares = 0.0f;
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float r = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w != nullptr ? (x[i] * r) * w[i] : x[i] * r;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

// out[i] *= sigmoid(gate[i]) for i < n: the mixers' output gates, 8 values at a time (k3_math::map8)
inline void gate_by_sigmoid(float* out, const float* gate, int64_t n) {
  k3_math::map8(out, gate, n, [](__m256 o, __m256 g) __attribute__((target("avx2,fma"))) {
    return _mm256_mul_ps(o, k3_math::sigmoid8(g));
  });
}

// The MLPs' and experts' act(gate, up) (k3_math::GatedActivation), checked.
inline k3_math::GatedActivation activation(int64_t kind, double beta, double linear_beta) {
  TORCH_CHECK(kind == 0 || kind == 1, "act must be 0 (SiLU-GLU) or 1 (SiTU)");
  return {kind, static_cast<float>(beta), static_cast<float>(linear_beta)};
}

// [..., n] fp32: x's leading dims ([B] for x [B, hidden], [B, 1] for a decode step's [B, 1, hidden], so that
// the model's tensors pass through without a reshape) with the last one n.
inline Tensor rows_like(const Tensor& x, int64_t n) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return torch::empty(sizes, x.options());
}

// The rows of x [..., width] (>= 2 dims): the product of its leading dims.
inline int64_t rows_of(const Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() >= 2 && x.size(-1) > 0, name, " must be [B, ..., width], got ", x.sizes());
  return x.numel() / x.size(-1);
}

inline const float* ptr(const Optional& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

}  // namespace decode_native
