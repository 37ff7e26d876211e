// An AVX-512 version of _native_products.h's `run` (the KDA chunk's small dense products): bit for bit its
// results.
//
// Every output element is computed as the AVX2 kernel computes it: acc = (sign * scale) * base (or 0),
// then acc = fma(a[m, k], b[k, n], acc) for k = 0, 1, ..., Kd - 1 in order, out = sign * acc. Only how
// many elements a register holds (16 instead of 8) and how many registers a block keeps (32 instead of
// 16) change, so the bits cannot. Blocks of 8 rows x 32 columns: 16 accumulators, two B loads and eight
// broadcasts per k for sixteen 16-lane FMAs (the AVX2 kernel's 6 x 16 block: eight loads for twelve
// 8-lane FMAs), and K3's chunk sizes (rows 16, 32 or 128; columns 128) split into whole blocks with no
// ragged tail. Columns left over after the 32-wide panels (N % 32) take 16-wide panels, then the AVX2
// kernel. On the 2-core AMD EPYC (Zen 4) dev box, where a 16-lane FMA takes both FMA pipes (the same peak
// as two 8-lane ones), the fused forward still ran 1.5x faster and the backward 1.4x (benchmarks/kda.py):
// the AVX2 kernel issues more loads and broadcasts per FMA, and K3's 16-row chunks left it a 4-row block.
// Included by _native_chunk.h and _native.cpp.

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
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const float* base = p.base + (m0 + r) * N + n0;
    const __m512 s = _mm512_mul_ps(sign, _mm512_set1_ps(p.scale ? p.scale[m0 + r] : 1.0f));
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) {
      acc[r][w] = p.base ? _mm512_mul_ps(s, _mm512_loadu_ps(base + 16 * w)) : _mm512_setzero_ps();
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
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) {
      _mm512_storeu_ps(p.out + (m0 + r) * N + n0 + 16 * w, _mm512_mul_ps(sign, acc[r][w]));
    }
  }
}

// The rows [0, M) in blocks of kWideRows, the last block shorter.
template <int W>
K3_KDA_AVX512 void wide_panel(const Product& p, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + kWideRows <= p.M; m0 += kWideRows) wide_block<kWideRows, W>(p, m0, n0);
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

}  // namespace
