// Small dense products and vector helpers for the KDA native kernels (_native.cpp), in AVX2 + FMA.
//
// The products are the sizes of one chunk: [C x K] x [K x V] and the like, with C = 16 and K = V = 128
// in K3, small enough to stay in L1/L2. `run_narrow` covers out = diag(scale) base + sign * A B with A read
// through strides (so A and A^T are both plain operands) and B row-major (_native_products512.h's `run`
// calls it, after its 16-lane panels where the CPU has AVX-512).
// Everything lives in an anonymous namespace: this header is included by _native.cpp only.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "_native_math.h"

namespace {

constexpr int kRows = 6;  // rows of the output per register block: 6 x 16 floats = 12 accumulators

// A matrix operand read element by element: (m, k) at data[m * row_stride + k * col_stride], so that
// A and A^T of a row-major matrix are both plain operands.
struct Operand {
  const float* data;
  int64_t row_stride;
  int64_t col_stride;
};

// Cache lines wanted soon (the rows of the chunk loaded next), asked for a few at a time between a product's
// register blocks. Asked for all at once, a burst of hundreds of requests overran the core's outstanding
// misses and did nearly nothing: on Zen 3 the fused forward copied its rows from memory as if never asked
// for (a loop copying 16 rows of four tensors between 35 us of FMAs: 3.4 us a step with the burst, 4.0
// without, 1.4 with the requests spread). Spread this way (16 lines a block) the forward ran 3-6 % faster
// and the backward 1-3 % (T = 4,096, H = 8 and 96, 1 and 2 threads; the same bits).
struct LineRequests {
  static constexpr size_t kPerBlock = 16;
  std::vector<const char*> lines;
  size_t next = 0;
  void clear() { lines.clear(), next = 0; }
  void add(const float* x, int64_t n) {  // the lines of x[0, n)
    for (int64_t j = 0; j < n; j += 16) lines.push_back(reinterpret_cast<const char*>(x + j));
  }
  void ask(size_t count) {
    for (const size_t end = std::min(lines.size(), next + count); next < end; ++next) {
      _mm_prefetch(lines[next], _MM_HINT_T0);
    }
  }
};

// One product, out[M, N] = diag(scale) base diag(col_scale) + sign * A[M, Kd] B[Kd, N], with B and out
// row-major (leading dimension N), base [M, N] (may be out itself, or nullptr for zero), scale [M] or
// col_scale [N] (one of them at most; nullptr for ones); `ahead`, if given, asks for some of its lines before
// each register block.
struct Product {
  int64_t M, N, Kd;
  Operand a;
  const float* b;
  float sign;
  const float* base;
  const float* scale;
  float* out;
  LineRequests* ahead = nullptr;
  const float* col_scale = nullptr;
};

// Rows [m0, m0 + R) x columns [n0, n0 + 8 * W) of a Product, accumulated in registers over all of Kd. The sign is
// applied once at the end: acc = factor * base with factor = sign * scale per row [M], or sign * col_scale per column
// [N] (computed once a product, by register_blocks), acc += A B, out = sign * acc. KD is Kd where the caller knows it
// (K3's chunk products over C = 16 and 2C = 32: the loop unrolled), else 0. BY_COLUMN: p has col_scale (a template
// argument, so that the other products' blocks compile as before: with a run-time test in every block, and one loop
// computing either factors, the forward ran 5 % slower on Zen 3).
template <int R, int W, int KD, bool BY_COLUMN>
__attribute__((target("avx2,fma"))) inline void register_block(const Product& p, const float* factor, int64_t m0,
                                                               int64_t n0) {
  // p's fields as locals: stores through out could otherwise alias p, and every row's would reload it
  const int64_t N = p.N, Kd = KD ? KD : p.Kd, a_rows = p.a.row_stride, a_cols = p.a.col_stride;
  const float* const base = p.base ? p.base + m0 * N + n0 : nullptr;
  const float* const a = p.a.data + m0 * a_rows;
  const float* const b = p.b + n0;
  float* const out = p.out + m0 * N + n0;
  const float sign_value = p.sign;
  const __m256 sign = _mm256_set1_ps(sign_value);
  __m256 acc[R][W];
  if (BY_COLUMN && base) {
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) {
      const __m256 s = _mm256_loadu_ps(factor + n0 + 8 * w);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][w] = _mm256_mul_ps(s, _mm256_loadu_ps(base + r * N + 8 * w));
    }
  } else if (base) {  // tested once a block, not once a row
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_broadcast_ss(factor + m0 + r);
#pragma GCC unroll 2
      for (int w = 0; w < W; ++w) acc[r][w] = _mm256_mul_ps(s, _mm256_loadu_ps(base + r * N + 8 * w));
    }
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int w = 0; w < W; ++w) acc[r][w] = _mm256_setzero_ps();
    }
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < Kd; ++k) {
    __m256 b_k[W];
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) b_k[w] = _mm256_loadu_ps(b + k * N + 8 * w);
    const float* a_k = a + k * a_cols;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a_k + r * a_rows);
#pragma GCC unroll 2
      for (int w = 0; w < W; ++w) acc[r][w] = _mm256_fmadd_ps(x, b_k[w], acc[r][w]);
    }
  }
  const bool negate = sign_value != 1.0f;  // a multiply by one is the identity: skipped (FMA pipes' time)
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) {
      _mm256_storeu_ps(out + r * N + 8 * w, negate ? _mm256_mul_ps(sign, acc[r][w]) : acc[r][w]);
    }
  }
}

// The R-row block at m0 across the columns [n0, n_end) (a multiple of 8 of them): 16 at a time, then 8.
template <int R, int KD, bool BY_COLUMN>
__attribute__((target("avx2,fma"))) void row_block(const Product& p, const float* factor, int64_t m0, int64_t n0,
                                                   int64_t n_end) {
  for (; n0 + 16 <= n_end; n0 += 16) register_block<R, 2, KD, BY_COLUMN>(p, factor, m0, n0);
  if (n0 < n_end) register_block<R, 1, KD, BY_COLUMN>(p, factor, m0, n0);
}

template <int KD, bool BY_COLUMN>
__attribute__((target("avx2,fma"))) void row_block(const Product& p, const float* factor, int64_t m0, int R,
                                                   int64_t n0, int64_t n_end) {
  switch (R) {
    case 6: row_block<6, KD, BY_COLUMN>(p, factor, m0, n0, n_end); break;
    case 5: row_block<5, KD, BY_COLUMN>(p, factor, m0, n0, n_end); break;
    case 4: row_block<4, KD, BY_COLUMN>(p, factor, m0, n0, n_end); break;
    case 3: row_block<3, KD, BY_COLUMN>(p, factor, m0, n0, n_end); break;
    case 2: row_block<2, KD, BY_COLUMN>(p, factor, m0, n0, n_end); break;
    case 1: row_block<1, KD, BY_COLUMN>(p, factor, m0, n0, n_end); break;
    default: break;
  }
}

// The rows of the block starting at m0 of M: blocks of kRows and, where M allows, of kRows - 1 so that none
// is shorter: M = 32 as 6 + 6 + 5 + 5 + 5 + 5 rather than 6 x 5 + 2. A block of R rows keeps 2R chains of
// FMAs in flight, and two pipes of 4-cycle FMAs need 8: two rows run at half the rate (Zen 3, T = 4,096,
// H = 8: the forward 2-4 % faster). Else the last block is shorter. Each output element is summed the same
// way in any block.
inline int block_rows(int64_t M, int64_t m0) {
  const int64_t short_blocks = (kRows - M % kRows) % kRows;  // of kRows - 1 rows
  if ((kRows - 1) * short_blocks <= M) return m0 < M - (kRows - 1) * short_blocks ? kRows : kRows - 1;
  return static_cast<int>(std::min<int64_t>(kRows, M - m0));
}

// The columns [n0, n_end) of a Product (a multiple of 8 of them). Where B's rows are short (Kd <= 32: at most
// 16 kB of B in K3, which stays in L1) each row block walks all the columns, so that base and out are read
// and written row after row. Else every row block walks one 16-column panel of B (Kd x 64 bytes, kept in
// L1) before the next panel, as in a GEMM. (Zen 3, one core: the state's update S = diag(gamma) S + K_hat^T u,
// Kd = 16, went from 71 to 79 GFLOP/s with rows outer, Kd unrolled and the row factors taken once a product;
// the backward's dS = diag(gamma) dS + [q Gamma; W]^T [d_o; -du], Kd = 32, from 76 to 86.)
template <int KD, bool BY_COLUMN>
__attribute__((target("avx2,fma"))) void row_blocks(const Product& p, const float* factor, int64_t n0,
                                                    int64_t n_end) {
  if (p.Kd <= 32) {
    for (int64_t m0 = 0, R; m0 < p.M; m0 += R) {
      if (p.ahead) p.ahead->ask(LineRequests::kPerBlock);
      row_block<KD, BY_COLUMN>(p, factor, m0, R = block_rows(p.M, m0), n0, n_end);
    }
    return;
  }
  for (; n0 < n_end; n0 += 16) {
    for (int64_t m0 = 0, R; m0 < p.M; m0 += R) {
      if (p.ahead) p.ahead->ask(LineRequests::kPerBlock);
      row_block<KD, BY_COLUMN>(p, factor, m0, R = block_rows(p.M, m0), n0, std::min<int64_t>(n0 + 16, n_end));
    }
  }
}

// row_blocks with Kd as a template argument where it is 16 or 32
template <bool BY_COLUMN>
__attribute__((target("avx2,fma"))) void row_blocks_for_kd(const Product& p, const float* factor, int64_t n0,
                                                           int64_t n_end) {
  if (p.Kd == 16) {
    row_blocks<16, BY_COLUMN>(p, factor, n0, n_end);
  } else if (p.Kd == 32) {
    row_blocks<32, BY_COLUMN>(p, factor, n0, n_end);
  } else {
    row_blocks<0, BY_COLUMN>(p, factor, n0, n_end);
  }
}

// The columns [n0, n_end) in register blocks (n_end - n0 > 0, a multiple of 8).
__attribute__((target("avx2,fma"))) void register_blocks(const Product& p, int64_t n0, int64_t n_end) {
  // what multiplies base's rows (sign * scale, or sign) or columns (sign * col_scale), computed once a
  // product rather than once a block
  constexpr int64_t kOnStack = 256;  // K3's largest M and N are 128
  float on_stack[kOnStack];
  const int64_t factors = p.col_scale ? p.N : p.M;
  std::vector<float> on_heap(p.base && factors > kOnStack ? factors : 0);
  float* const factor = factors > kOnStack ? on_heap.data() : on_stack;
  if (p.base && p.col_scale) {
    for (int64_t n = 0; n < p.N; ++n) factor[n] = p.sign * p.col_scale[n];
  } else if (p.base) {
    for (int64_t m = 0; m < p.M; ++m) factor[m] = p.sign * (p.scale ? p.scale[m] : 1.0f);
  }
  if (p.col_scale) {
    row_blocks_for_kd<true>(p, factor, n0, n_end);
  } else {
    row_blocks_for_kd<false>(p, factor, n0, n_end);
  }
}

// The columns [n0, N): register blocks over the multiple of 8 (none where the 16-lane panels took every
// column), then single columns for the rest. (`run`, in _native_products512.h, calls it.)
__attribute__((target("avx2,fma"))) void run_narrow(const Product& p, int64_t n0) {
  const int64_t n_end = n0 + (p.N - n0) / 8 * 8;
  if (n0 < n_end) register_blocks(p, n0, n_end);
  for (n0 = n_end; n0 < p.N; ++n0) {
    for (int64_t m = 0; m < p.M; ++m) {
      const float factor = (p.scale ? p.scale[m] : 1.0f) * (p.col_scale ? p.col_scale[n0] : 1.0f);
      float acc = p.base ? factor * p.base[m * p.N + n0] : 0.0f;
      for (int64_t k = 0; k < p.Kd; ++k) {
        acc += p.sign * p.a.data[m * p.a.row_stride + k * p.a.col_stride] * p.b[k * p.N + n0];
      }
      p.out[m * p.N + n0] = acc;
    }
  }
}

Operand plain(const float* data, int64_t cols) { return {data, cols, 1}; }
Operand transposed(const float* data, int64_t cols) { return {data, 1, cols}; }

// y[i] = column i of the 8 x 8 block at src (rows `cols` floats apart), in registers. Each register is
// loaded as two 128-bit halves, four columns of row r and the same four of row r + 4, so that the transpose
// needs in-lane shuffles only: 16, against 24 with a lane-crossing third stage. On Zen 3 a [128 x 128]
// transpose from L2 took 3.1 us this way against 4.4, a [16 x 128] one 0.33 against 0.55.
__attribute__((target("avx2,fma"))) inline void transpose_block(const float* src, int64_t cols, __m256 y[8]) {
  __m256 x[8];  // x[r] = columns 0-3 of rows r and r + 4, x[r + 4] = their columns 4-7 (r < 4)
  for (int r = 0; r < 4; ++r) {
    const float *top = src + r * cols, *bottom = src + (r + 4) * cols;
    x[r] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(top)), _mm_loadu_ps(bottom), 1);
    x[r + 4] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(top + 4)), _mm_loadu_ps(bottom + 4), 1);
  }
  for (int half = 0; half < 8; half += 4) {  // a 4 x 4 transpose in each 128-bit lane
    const __m256 ab_lo = _mm256_unpacklo_ps(x[half], x[half + 1]);
    const __m256 ab_hi = _mm256_unpackhi_ps(x[half], x[half + 1]);
    const __m256 cd_lo = _mm256_unpacklo_ps(x[half + 2], x[half + 3]);
    const __m256 cd_hi = _mm256_unpackhi_ps(x[half + 2], x[half + 3]);
    y[half] = _mm256_shuffle_ps(ab_lo, cd_lo, 0x44);
    y[half + 1] = _mm256_shuffle_ps(ab_lo, cd_lo, 0xEE);
    y[half + 2] = _mm256_shuffle_ps(ab_hi, cd_hi, 0x44);
    y[half + 3] = _mm256_shuffle_ps(ab_hi, cd_hi, 0xEE);
  }
}

// dst [cols, rows] = src [rows, cols]^T, by 8 x 8 blocks in registers where both sizes allow
__attribute__((target("avx2,fma"))) void transpose_into(const float* src, int64_t rows, int64_t cols, float* dst) {
  if (rows % 8 || cols % 8) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
    }
    return;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    for (int64_t c0 = 0; c0 < cols; c0 += 8) {
      __m256 y[8];
      transpose_block(src + r0 * cols + c0, cols, y);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (c0 + i) * rows + r0, y[i]);
    }
  }
}

// dst [cols, rows] = src [rows, cols]^T with non-temporal stores (a state kept for the backward: neither kept
// in cache nor read in first), for sizes that are multiples of 8 and a 32-byte aligned dst (else
// transpose_into). The blocks go down src's columns, so each row of dst is written front to back and the
// write-combining buffers fill whole lines: 3.1-3.5 us for a [128, 128] state on Zen 3, against 6.4-6.8 for
// transpose_into then stream_copy. The caller issues _mm_sfence() before another thread may read dst.
__attribute__((target("avx2,fma"))) void transpose_streamed(const float* src, int64_t rows, int64_t cols,
                                                            float* dst) {
  if (rows % 8 || cols % 8 || reinterpret_cast<uintptr_t>(dst) % 32) return transpose_into(src, rows, cols, dst);
  for (int64_t c0 = 0; c0 < cols; c0 += 8) {
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      __m256 y[8];
      transpose_block(src + r0 * cols + c0, cols, y);
      for (int i = 0; i < 8; ++i) _mm256_stream_ps(dst + (c0 + i) * rows + r0, y[i]);
    }
  }
}

// horizontal sum of the 8 lanes
__attribute__((target("avx2,fma"))) inline float lane_sum(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

// out[0, n) = x * factor
__attribute__((target("avx2,fma"))) void scale_copy(const float* x, float factor, int64_t n, float* out) {
  const __m256 f = _mm256_set1_ps(factor);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), f));
  for (; j < n; ++j) out[j] = x[j] * factor;
}

// out[r] = sum_j a[r, j] b[r, j] for [rows, cols] row-major a and b
__attribute__((target("avx2,fma"))) void row_dots(const float* a, const float* b, int64_t rows, int64_t cols,
                                                  float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *ar = a + r * cols, *br = b + r * cols;
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= cols; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(ar + j), _mm256_loadu_ps(br + j), acc);
    float total = lane_sum(acc);
    for (; j < cols; ++j) total += ar[j] * br[j];
    out[r] = total;
  }
}

// out[c] = sum_r a[r, c] b[r, c] for [rows, cols] row-major a and b: 64 columns at a time in 8 registers, so
// that each row's 256 bytes of a block are read at once (one column group at a time read every cache
// line twice, 8 groups of rows apart)
__attribute__((target("avx2,fma"))) void column_dots(const float* a, const float* b, int64_t rows, int64_t cols,
                                                     float* out) {
  constexpr int kGroups = 8;
  int64_t c0 = 0;
  for (; c0 + 8 * kGroups <= cols; c0 += 8 * kGroups) {
    __m256 acc[kGroups];
    for (int g = 0; g < kGroups; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const float *ar = a + r * cols + c0, *br = b + r * cols + c0;
#pragma GCC unroll 8
      for (int g = 0; g < kGroups; ++g) {
        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(ar + 8 * g), _mm256_loadu_ps(br + 8 * g), acc[g]);
      }
    }
    for (int g = 0; g < kGroups; ++g) _mm256_storeu_ps(out + c0 + 8 * g, acc[g]);
  }
  for (; c0 + 8 <= cols; c0 += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + r * cols + c0), _mm256_loadu_ps(b + r * cols + c0), acc);
    }
    _mm256_storeu_ps(out + c0, acc);
  }
  for (; c0 < cols; ++c0) {
    float total = 0.0f;
    for (int64_t r = 0; r < rows; ++r) total += a[r * cols + c0] * b[r * cols + c0];
    out[c0] = total;
  }
}

using k3_math::exp8;

// dst[0, n) = src[0, n), with non-temporal stores where dst is 32-byte aligned: for data that is read
// again much later (the states kept for the backward), so neither kept in cache nor read in first.
// The caller issues _mm_sfence() before another thread may read dst.
__attribute__((target("avx2,fma"))) void stream_copy(const float* src, float* dst, int64_t n) {
  if (reinterpret_cast<uintptr_t>(dst) % 32 || n % 8) {
    for (int64_t j = 0; j < n; ++j) dst[j] = src[j];
    return;
  }
  for (int64_t j = 0; j < n; j += 8) _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
}

// out[j] = exp(x[j]) for j < n
__attribute__((target("avx2,fma"))) void exp_into(const float* x, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, exp8(_mm256_loadu_ps(x + j)));
  for (; j < n; ++j) out[j] = std::exp(x[j]);
}


}  // namespace
