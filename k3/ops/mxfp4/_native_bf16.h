// MXFP4 matrix rows times a few bfloat16 vectors with bf16 dot products (AVX-512 BF16: vdpbf16ps), the
// small-M path of a bfloat16 x (k3's bf16 compute mode): out[r, n] = sum_k x[r, k] * W[n, k].
//
// Per block of 32 codes: the codes are decoded as in _native_rows512.h (a 16-float table of the E2M1 codes
// times two, vpermps), scaled by the block's half scale in fp32 (exact) and packed into 32 bfloat16 weights
// (exact: two significant bits; values below 2^-126, which no real checkpoint holds, flush to zero as the
// instructions define). Then one vdpbf16ps per row of x adds the 32 products into 16 fp32 lanes, so a block
// costs one instruction a row where the fp32 kernels spend four 8-lane FMAs: twice the products per
// instruction of 16-lane fp32. Each output is summed in one fixed order by one thread: its bits depend on
// neither the thread count nor the other rows of x (a row alone or in a batch: the same bits). They may
// differ between CPU makers: how vdpbf16ps rounds inside its pair of products is the vendor's.
#pragma once

#include "_native_rows.h"
#include "_native_rows512.h"

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace mxfp4_bf16 {

using mxfp4_rows::kBlock;
using mxfp4_rows::kBlockBytes;
using mxfp4_rows::kHalfScale;
using mxfp4_rows::kMaxRows;

#define K3_AVX512_BF16 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16");
}

// The 32 weights of one block as bfloat16, in element order (pairs (2i, 2i+1) in lane i, as vdpbf16ps
// pairs them with x).
K3_AVX512_BF16 inline __m512bh decode_block(const uint8_t* bytes, float half_scale, __m512 table) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(packed, low_mask);                     // elements 0, 2, 4, ...
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low_mask);  // elements 1, 3, 5, ...
  const __m512 s = _mm512_set1_ps(half_scale);
  const __m512 first = _mm512_mul_ps(  // elements 0..15
      _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), table), s);
  const __m512 second = _mm512_mul_ps(  // elements 16..31
      _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), table), s);
  return _mm512_cvtne2ps_pbh(second, first);  // first in the low half
}

// out[r * N + n] for r < ROWS and n in [n_begin, n_end); x [ROWS, K] bfloat16 (row stride K).
template <int ROWS>
K3_AVX512_BF16 void gemv_rows(const c10::BFloat16* x, const uint8_t* packed, const uint8_t* scale, int64_t K,
                              int64_t N, c10::BFloat16* out, int64_t n_begin, int64_t n_end) {
  const int64_t blocks = K / kBlock;
  const __m512 table = _mm512_load_ps(mxfp4_rows512::kCodeTimesTwoF);  // E2M1 codes times two
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row_bytes = packed + n * (K / 2);
    const uint8_t* row_scale = scale + n * blocks;
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512bh w = decode_block(row_bytes + b * kBlockBytes, kHalfScale.value[row_scale[b]], table);
      const c10::BFloat16* xb = x + b * kBlock;
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh xr = (__m512bh)_mm512_loadu_si512(xb + r * K);
        acc[r] = _mm512_dpbf16_ps(acc[r], w, xr);
      }
    }
    for (int r = 0; r < ROWS; ++r) out[r * N + n] = c10::BFloat16(_mm512_reduce_add_ps(acc[r]));
  }
}

using GemvRowsFn = void (*)(const c10::BFloat16*, const uint8_t*, const uint8_t*, int64_t, int64_t,
                            c10::BFloat16*, int64_t, int64_t);
constexpr GemvRowsFn kGemvRows[kMaxRows + 1] = {nullptr,       gemv_rows<1>, gemv_rows<2>,
                                                 gemv_rows<3>, gemv_rows<4>, gemv_rows<5>,
                                                 gemv_rows<6>, gemv_rows<7>, gemv_rows<8>};

#undef K3_AVX512_BF16

}  // namespace mxfp4_bf16
