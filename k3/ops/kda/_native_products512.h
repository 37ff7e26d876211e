// AVX-512 versions of _native_products.h's kernels for the KDA chunk: `run` (the small dense products) and
// `transpose`, bit for bit their results; `product_with_transpose` (a b^T) is a transpose and a `run`.
//
// Every output element of `run` is computed as the AVX2 kernel computes it: acc = (sign * scale) * base (or
// 0), then acc = fma(a[m, k], b[k, n], acc) for k = 0, 1, ..., Kd - 1 in order, out = sign * acc. Only how
// many elements a register holds (16 instead of 8) and how many registers a block keeps (32 instead of
// 16) change, so the bits cannot. Blocks of 8 rows x 32 columns: 16 accumulators, two B loads and eight
// broadcasts per k for sixteen 16-lane FMAs (the AVX2 kernel's 6 x 16 block: eight loads for twelve
// 8-lane FMAs), and K3's chunk sizes (rows 16, 32 or 128; columns 128) split into whole blocks with no
// ragged tail. Columns left over after the 32-wide panels (N % 32) take 16-wide panels, then the AVX2
// kernel. On the 2-core AMD EPYC dev box (CPU family 26, Zen 5) the fused forward ran 1.5x
// faster and the backward 1.4x (benchmarks/kda.py): the AVX2 kernel issues more loads and broadcasts per
// FMA, and K3's 16-row chunks left it a 4-row block. Included by _native_chunk.h and _native.cpp.

#pragma once

#include "_native_common.h"
#include "_native_products.h"

#include <immintrin.h>

#include <cstdint>
#include <string>

namespace {

#define K3_KDA_AVX512 __attribute__((target("avx2,fma,avx512f")))

inline bool avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

// The products in use on this CPU: "avx512" where it has AVX-512 F, else "avx2".
inline std::string products_variant() {
  static const bool supported = avx512_supported();
  return supported ? "avx512" : "avx2";
}

// Whether `variant` asks for the 16-lane products: "auto" (products_variant()), "avx2" or "avx512".
inline bool wide_products(const std::string& variant) {
  return k3_native::wide_variant(variant, products_variant() == "avx512", "F");
}

constexpr int kWideRows = 8;  // rows of the output per 16-lane register block: 8 x 32 floats = 16 accumulators

// Rows [m0, m0 + R) x columns [n0, n0 + 16 * W) of a Product, accumulated in registers over all of Kd.
template <int R, int W>
K3_KDA_AVX512 inline void wide_block(const Product& p, int64_t m0, int64_t n0) {
  const int64_t N = p.N, Kd = p.Kd, a_rows = p.a.row_stride, a_cols = p.a.col_stride;
  const __m512 sign = _mm512_set1_ps(p.sign);
  __m512 acc[R][W];
  __m512 col_factor[W];  // sign * col_scale, once a block (the same values as register_block's factors)
#pragma GCC unroll 2
  for (int w = 0; w < W; ++w) {
    col_factor[w] = p.col_scale ? _mm512_mul_ps(sign, _mm512_loadu_ps(p.col_scale + n0 + 16 * w)) : sign;
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const float* base = p.base + (m0 + r) * N + n0;
    const __m512 s = _mm512_mul_ps(sign, _mm512_set1_ps(p.scale ? p.scale[m0 + r] : 1.0f));
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) {  // sign * col_scale, or sign * scale
      const __m512 factor = p.col_scale ? col_factor[w] : s;
      acc[r][w] = p.base ? _mm512_mul_ps(factor, _mm512_loadu_ps(base + 16 * w)) : _mm512_setzero_ps();
    }
  }
  const float* a = p.a.data + m0 * a_rows;
  const float* b = p.b + n0;
  for (int64_t k = 0; k < Kd; ++k) {
    __m512 b_k[W];
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) b_k[w] = _mm512_loadu_ps(b + k * N + 16 * w);
    const float* a_k = a + k * a_cols;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a_k[r * a_rows]);
#pragma GCC unroll 2
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_fmadd_ps(x, b_k[w], acc[r][w]);
    }
  }
  const bool negate = p.sign != 1.0f;  // as register_block: a multiply by one skipped
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) {
      _mm512_storeu_ps(p.out + (m0 + r) * N + n0 + 16 * w, negate ? _mm512_mul_ps(sign, acc[r][w]) : acc[r][w]);
    }
  }
}

// The rows [0, M) in blocks of kWideRows, the last block shorter.
template <int W>
K3_KDA_AVX512 void wide_panel(const Product& p, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + kWideRows <= p.M; m0 += kWideRows) {
    if (p.ahead) p.ahead->ask(LineRequests::kPerBlock);
    wide_block<kWideRows, W>(p, m0, n0);
  }
  switch (p.M - m0) {
    case 7: wide_block<7, W>(p, m0, n0); break;
    case 6: wide_block<6, W>(p, m0, n0); break;
    case 5: wide_block<5, W>(p, m0, n0); break;
    case 4: wide_block<4, W>(p, m0, n0); break;
    case 3: wide_block<3, W>(p, m0, n0); break;
    case 2: wide_block<2, W>(p, m0, n0); break;
    case 1: wide_block<1, W>(p, m0, n0); break;
    default: break;
  }
}

// Columns from 0 in panels of 32, then 16; returns where the AVX2 kernel takes over.
K3_KDA_AVX512 int64_t run_wide(const Product& p) {
  int64_t n0 = 0;
  for (; n0 + 32 <= p.N; n0 += 32) wide_panel<2>(p, n0);
  for (; n0 + 16 <= p.N; n0 += 16) wide_panel<1>(p, n0);
  return n0;
}

// out[M, N] = diag(scale) base + sign * A B (see Product): 16-lane panels where `wide`, the rest in 8 lanes.
void run(const Product& p, bool wide) { run_narrow(p, wide ? run_wide(p) : 0); }

// dst [cols, rows] = src [rows, cols]^T for sizes that are multiples of 16, by 16 x 16 blocks in registers
// (64 shuffles per block against the 8 x 8 kernel's 96 for the same 256 floats).
K3_KDA_AVX512 void transpose_wide(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      __m512 x[16], y[16];
      for (int i = 0; i < 16; ++i) x[i] = _mm512_loadu_ps(src + (r0 + i) * cols + c0);
      for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved, in each 128-bit lane
        y[i] = _mm512_unpacklo_ps(x[i], x[i + 1]);
        y[i + 1] = _mm512_unpackhi_ps(x[i], x[i + 1]);
      }
      for (int i = 0; i < 16; i += 4) {  // now x[4 g + j]'s lane L is column 4 L + j of rows 4 g .. 4 g + 3
        x[i] = _mm512_shuffle_ps(y[i], y[i + 2], 0x44);
        x[i + 1] = _mm512_shuffle_ps(y[i], y[i + 2], 0xEE);
        x[i + 2] = _mm512_shuffle_ps(y[i + 1], y[i + 3], 0x44);
        x[i + 3] = _mm512_shuffle_ps(y[i + 1], y[i + 3], 0xEE);
      }
      for (int j = 0; j < 4; ++j) {  // a 4 x 4 transpose of 128-bit lanes: column 4 L + j takes each g's lane L
        const __m512 t0 = _mm512_shuffle_f32x4(x[j], x[4 + j], 0x44);
        const __m512 t1 = _mm512_shuffle_f32x4(x[j], x[4 + j], 0xEE);
        const __m512 t2 = _mm512_shuffle_f32x4(x[8 + j], x[12 + j], 0x44);
        const __m512 t3 = _mm512_shuffle_f32x4(x[8 + j], x[12 + j], 0xEE);
        y[j] = _mm512_shuffle_f32x4(t0, t2, 0x88);
        y[4 + j] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
        y[8 + j] = _mm512_shuffle_f32x4(t1, t3, 0x88);
        y[12 + j] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
      }
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + (c0 + i) * rows + r0, y[i]);
    }
  }
}

// dst [cols, rows] = src [rows, cols]^T: transpose_wide where `wide` and both sizes allow, else
// transpose_into. Pure data movement: the variants give the same bits. (Not compiled for AVX-512 itself:
// an AVX2-only CPU runs this function.)
void transpose(const float* src, int64_t rows, int64_t cols, float* dst, bool wide) {
  if (wide && rows % 16 == 0 && cols % 16 == 0) {
    transpose_wide(src, rows, cols, dst);
  } else {
    transpose_into(src, rows, cols, dst);
  }
}

// out[M, N] (+)= sign * a[M, Kd] b[N, Kd]^T, a and b row-major (e.g. the products with a state's
// transpose); `accumulate` adds to out instead of overwriting it. b is transposed into b_t [Kd, N] (scratch)
// and the product is one `run`: register blocks with a chain of FMAs per element, the same bits in 8 and 16
// lanes. (Until 2026-12-06 each element was an 8-lane dot product ended by a horizontal sum, out of line: on
// Zen 3 those sums and calls were 6 % of the backward's time for 4 % of its FLOPs.)
void product_with_transpose(const float* a, const float* b, int64_t M, int64_t N, int64_t Kd, float sign,
                            float* out, bool accumulate, float* b_t, bool wide) {
  transpose(b, N, Kd, b_t, wide);
  run({M, N, Kd, plain(a, Kd), b_t, sign, accumulate ? out : nullptr, nullptr, out}, wide);
}

}  // namespace
