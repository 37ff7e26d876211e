// Sums of weighted rows for the decode step's mixers: y += a x (axpy) and MLA's weighted sum of its cached
// latent rows for a group of heads at once (weighted_rows). Included by _native_mixers.h and _native.cpp.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "_native_gemv.h"

namespace decode_native {

// y[i] += a * x[i], x fp32 or BF16
template <typename T>
__attribute__((target("avx2,fma"))) inline void axpy(float a, const T* x, int64_t n, float* y) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load8(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * to_float(x[i]);
}

// o[j, :] += sum_t a[j * S + t] c[t, :] for the G <= 8 rows of o (G heads' weights over S cached rows of L
// values): each value is axpy's chain o = fma(a_t, c_t, o) over t = 0, 1, ..., S - 1 in order, so the bits are
// those of G x S axpy calls. Kept in registers over a tile of kWeightedTile positions (their rows stay in
// L2) for a block of columns: in 8 lanes, 8 columns x G heads; in 16 (AVX-512), 32 columns x G heads in 16
// registers. The columns past the last whole block go through axpy itself.
constexpr int64_t kWeightedTile = 64;

template <int G>
__attribute__((target("avx2,fma"))) inline void weighted_block8(const float* a, int64_t S, const float* c,
                                                                int64_t L, float* o, int64_t l0, int64_t t0,
                                                                int64_t t1) {
  __m256 acc[G];
  for (int j = 0; j < G; ++j) acc[j] = _mm256_loadu_ps(o + j * L + l0);
  for (int64_t t = t0; t < t1; ++t) {
    const __m256 row = _mm256_loadu_ps(c + t * L + l0);
    for (int j = 0; j < G; ++j) acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(a[j * S + t]), row, acc[j]);
  }
  for (int j = 0; j < G; ++j) _mm256_storeu_ps(o + j * L + l0, acc[j]);
}

template <int G>
K3_DECODE_AVX512 inline void weighted_block32(const float* a, int64_t S, const float* c, int64_t L, float* o,
                                              int64_t l0, int64_t t0, int64_t t1) {
  __m512 acc[G][2];
  for (int j = 0; j < G; ++j)
    for (int h = 0; h < 2; ++h) acc[j][h] = _mm512_loadu_ps(o + j * L + l0 + 16 * h);
  for (int64_t t = t0; t < t1; ++t) {
    const __m512 low = _mm512_loadu_ps(c + t * L + l0), high = _mm512_loadu_ps(c + t * L + l0 + 16);
    for (int j = 0; j < G; ++j) {
      const __m512 w = _mm512_set1_ps(a[j * S + t]);
      acc[j][0] = _mm512_fmadd_ps(w, low, acc[j][0]);
      acc[j][1] = _mm512_fmadd_ps(w, high, acc[j][1]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(o + j * L + l0 + 16 * h, acc[j][h]);
}

template <int G>
inline void weighted_rows_of(const float* a, int64_t S, const float* c, int64_t L, float* o, bool wide,
                             int64_t from, int64_t to) {
  const int64_t wide_end = wide ? L - L % 32 : 0, body = L - L % 8;
  for (int64_t t0 = from; t0 < to; t0 += kWeightedTile) {
    const int64_t t1 = std::min(to, t0 + kWeightedTile);
    for (int64_t l0 = 0; l0 < wide_end; l0 += 32) weighted_block32<G>(a, S, c, L, o, l0, t0, t1);
    for (int64_t l0 = wide_end; l0 < body; l0 += 8) weighted_block8<G>(a, S, c, L, o, l0, t0, t1);
    for (int64_t t = t0; body < L && t < t1; ++t)
      for (int j = 0; j < G; ++j) axpy(a[j * S + t], c + t * L + body, L - body, o + j * L + body);
  }
}

// The positions [from, to) of them (all S by default): o continues each value's chain, so positions taken range
// after range, in order, give the bits of all of them at once.
inline void weighted_rows(const float* a, int64_t S, int64_t G, const float* c, int64_t L, float* o, bool wide,
                          int64_t from = 0, int64_t to = -1) {
  if (to < 0) to = S;
  switch (G) {
    case 1: return weighted_rows_of<1>(a, S, c, L, o, wide, from, to);
    case 2: return weighted_rows_of<2>(a, S, c, L, o, wide, from, to);
    case 3: return weighted_rows_of<3>(a, S, c, L, o, wide, from, to);
    case 4: return weighted_rows_of<4>(a, S, c, L, o, wide, from, to);
    case 5: return weighted_rows_of<5>(a, S, c, L, o, wide, from, to);
    case 6: return weighted_rows_of<6>(a, S, c, L, o, wide, from, to);
    case 7: return weighted_rows_of<7>(a, S, c, L, o, wide, from, to);
    case 8: return weighted_rows_of<8>(a, S, c, L, o, wide, from, to);
    default: TORCH_CHECK(false, "weighted_rows takes 1 to 8 rows, got ", G);
  }
}

}  // namespace decode_native
