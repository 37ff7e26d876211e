// MXFP4 (and plain fp32) matrix rows times vectors, shared by the MXFP4 kernels (_native.cpp) and the fused
// decode-layer kernels (k3/ops/decode/_native.cpp): the E2M1 block decoder, one-row and few-row GEMVs.
//
// Layout (compressed-tensors `mxfp4-pack-quantized`):
//   packed [N, K/2] uint8: element 2j in the low nibble of byte j, element 2j+1 in the high nibble
//   scale  [N, K/32] uint8: E8M0, byte s means 2^(s-127), 255 is NaN
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace mxfp4_rows {

constexpr int64_t kBlock = 32;      // elements per shared scale
constexpr int64_t kBlockBytes = 16; // packed bytes per block
constexpr int kMaxRows = 8;         // rows of x handled per pass over W in the small-M path

// E2M1 codes 0..15 times two, so that every value is an integer:
// +0 .5 1 1.5 2 3 4 6 -0 -.5 -1 -1.5 -2 -3 -4 -6  ->  0 1 2 3 4 6 8 12 0 -1 -2 -3 -4 -6 -8 -12
alignas(16) constexpr int8_t kCodeTimesTwo[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// half_scale[s] = 2^(s-127) / 2 (undoes the "times two" above); 255 is NaN. Every entry is exact in fp32
// (2^-128 is a subnormal), and so is every product code_times_two * half_scale.
struct HalfScaleTable {
  float value[256];
  HalfScaleTable() {
    for (int s = 0; s < 255; ++s) value[s] = std::ldexp(1.0f, s - 128);
    value[255] = std::numeric_limits<float>::quiet_NaN();
  }
};
inline const HalfScaleTable kHalfScale;

// Decodes the 16 bytes of one block into 32 integer-valued floats (codes times two), in element order.
__attribute__((target("avx2,fma"))) inline void decode_block(const uint8_t* bytes, __m256 w[4]) {
  const __m128i lut = _mm_load_si128(reinterpret_cast<const __m128i*>(kCodeTimesTwo));
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(packed, low_mask));                     // even
  const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(packed, 4), low_mask));  // odd
  const __m128i first = _mm_unpacklo_epi8(lo, hi);   // elements 0..15
  const __m128i second = _mm_unpackhi_epi8(lo, hi);  // elements 16..31
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8)));
}

__attribute__((target("avx2,fma"))) inline float horizontal_sum(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quad = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1)));
}

// out[0, n] = sum_k x[k] * W[n, k] for n in [n_begin, n_end): the M = 1 decode path.
// Per block the 32 products are summed unscaled, then scaled once: 4 FMAs + 1 FMA per 32 weights.
__attribute__((target("avx2,fma"))) inline void gemv_one_row(const float* x, const uint8_t* packed,
                                                      const uint8_t* scale, int64_t K, float* out,
                                                      int64_t n_begin, int64_t n_end) {
  const int64_t blocks = K / kBlock;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row_bytes = packed + n * (K / 2);
    const uint8_t* row_scale = scale + n * blocks;
    __m256 acc_even = _mm256_setzero_ps();  // two accumulators: consecutive blocks do not wait on each other
    __m256 acc_odd = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 w[4];
      decode_block(row_bytes + b * kBlockBytes, w);
      const float* xb = x + b * kBlock;
      __m256 left = _mm256_mul_ps(w[0], _mm256_loadu_ps(xb));
      __m256 right = _mm256_mul_ps(w[1], _mm256_loadu_ps(xb + 8));
      left = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), left);
      right = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), right);
      const __m256 s = _mm256_set1_ps(kHalfScale.value[row_scale[b]]);
      if (b & 1) {
        acc_odd = _mm256_fmadd_ps(s, _mm256_add_ps(left, right), acc_odd);
      } else {
        acc_even = _mm256_fmadd_ps(s, _mm256_add_ps(left, right), acc_even);
      }
    }
    out[n] = horizontal_sum(_mm256_add_ps(acc_even, acc_odd));
  }
}

// out[r, n] = sum_k x[r, k] * W[n, k] for ROWS rows of x (row stride K, output row stride N):
// each decoded block is scaled once and reused for all ROWS rows.
template <int ROWS>
__attribute__((target("avx2,fma"))) void gemv_rows(const float* x, const uint8_t* packed, const uint8_t* scale,
                                                   int64_t K, int64_t N, float* out, int64_t n_begin,
                                                   int64_t n_end) {
  const int64_t blocks = K / kBlock;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row_bytes = packed + n * (K / 2);
    const uint8_t* row_scale = scale + n * blocks;
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 w[4];
      decode_block(row_bytes + b * kBlockBytes, w);
      const __m256 s = _mm256_set1_ps(kHalfScale.value[row_scale[b]]);
      for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(w[i], s);
      const float* xb = x + b * kBlock;
      for (int r = 0; r < ROWS; ++r) {
        const float* xr = xb + r * K;
        // the block's partial sum is independent of earlier blocks; only one add per block is carried
        __m256 partial = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
        for (int i = 1; i < 4; ++i) partial = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), partial);
        acc[r] = _mm256_add_ps(acc[r], partial);
      }
    }
    for (int r = 0; r < ROWS; ++r) out[r * N + n] = horizontal_sum(acc[r]);
  }
}

using GemvRowsFn = void (*)(const float*, const uint8_t*, const uint8_t*, int64_t, int64_t, float*, int64_t,
                            int64_t);
constexpr GemvRowsFn kGemvRows[kMaxRows + 1] = {nullptr,       gemv_rows<1>, gemv_rows<2>,
                                                 gemv_rows<3>, gemv_rows<4>, gemv_rows<5>,
                                                 gemv_rows<6>, gemv_rows<7>, gemv_rows<8>};


// Dense fp32 rows: out[n] = W[n, :] . x for n in [0, N) (experts kept as plain fp32 weights).
__attribute__((target("avx2,fma"))) inline void gemv_dense(const float* x, const float* W, int64_t K, int64_t N,
                                                    float* out) {
  const int64_t body = K - K % 16;
  for (int64_t n = 0; n < N; ++n) {
    const float* row = W + n * K;
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    for (int64_t i = 0; i < body; i += 16) {
      a = _mm256_fmadd_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(x + i), a);
      b = _mm256_fmadd_ps(_mm256_loadu_ps(row + i + 8), _mm256_loadu_ps(x + i + 8), b);
    }
    float tail = 0.0f;
    for (int64_t i = body; i < K; ++i) tail += row[i] * x[i];
    out[n] = horizontal_sum(_mm256_add_ps(a, b)) + tail;
  }
}

}  // namespace mxfp4_rows
