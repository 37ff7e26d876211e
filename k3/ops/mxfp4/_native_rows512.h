// AVX-512 versions of the few-row MXFP4 GEMV of _native_rows.h (the decode step's experts, one to eight rows
// of x): bit for bit its results.
//
// One 16-lane register holds two weight rows: lanes 0-7 row n and lanes 8-15 row n + 1, each lane doing
// exactly what its AVX2 lane does for its row, in the same order (each step's eight values of x are
// broadcast to both halves). Decoding a step is a shift of the 16 words (the two rows' 32 bytes) and one
// lookup (vpermps) in a 16-float table of the E2M1 codes times two (kCodeTimesTwoF, as the AVX2 decoder
// gives them), which reads only the low 4 bits of each word:
// no byte shuffle, one vector operation per 16 codes besides the shift. An odd last weight row runs
// the AVX2 kernel. At one row of x (`gemv_row_twice`) x's values sit twice in memory instead, so the FMAs
// read them without a broadcast, and the scales are converted 16 blocks at a time (measured against
// gemv_rows_pairs<1>, the builds in one process, 44 experts cycled: 1.07x at 2 threads, 1.09x at 1).
#pragma once

#include "_native_common.h"
#include "_native_rows.h"

#include <immintrin.h>

#include <cstdint>
#include <string>
#include <vector>

namespace mxfp4_rows512 {

using mxfp4_rows::kBlock;
using mxfp4_rows::kBlockBytes;
using mxfp4_rows::kHalfScale;

#define K3_AVX512 __attribute__((target("avx2,fma,avx512f,avx512dq")))

inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

// The few-row GEMV in use on this CPU: "avx512" where it has what this file needs, else "avx2".
inline std::string gemv_variant() {
  static const bool supported = cpu_supported();
  return supported ? "avx512" : "avx2";
}

// Whether the kernels `variant` asks for are this file's: "auto" (gemv_variant()), "avx2" or "avx512".
inline bool wide_variant(const std::string& variant) {
  return k3_native::wide_variant(variant, gemv_variant() == "avx512", "F/DQ");
}

// E2M1 codes times two as floats, +0 for code 8 (-0): the AVX2 path converts the integer 0 to +0.
alignas(64) constexpr float kCodeTimesTwoF[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Rows n and n + 1's pair p (row_bytes: row n's, `row` bytes to the next) as the eight steps w[j]: lanes 0-7
// row n's element 8l + j times two (kCodeTimesTwoF), lanes 8-15 row n + 1's.
K3_AVX512 inline void two_rows_steps(const uint8_t* row_bytes, int64_t row, int64_t p, bool whole, __m512 w[8]) {
  const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(mxfp4_rows::pair_bytes(row_bytes, p, whole)),
                                           mxfp4_rows::pair_bytes(row_bytes + row, p, whole), 1);
  const __m512 table = _mm512_load_ps(kCodeTimesTwoF);
  w[0] = _mm512_permutexvar_ps(words, table);
  for (int j = 1; j < 8; ++j) w[j] = _mm512_permutexvar_ps(_mm512_srli_epi32(words, 4 * j), table);
}

// [row n's mxfp4_rows::pair_scale | row n + 1's] (row_scale: row n's, `blocks` scales to the next row)
K3_AVX512 inline __m512 two_rows_scale(const uint8_t* row_scale, int64_t blocks, int64_t p, bool whole) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(mxfp4_rows::pair_scale(row_scale, p, whole)),
                            mxfp4_rows::pair_scale(row_scale + blocks, p, whole), 1);
}

// acc[r] += rows n and n + 1's pair p times x's row r: mxfp4_rows::pair_products for two weight rows, each
// step's eight values of x broadcast to both halves.
template <int ROWS>
K3_AVX512 inline void two_rows_pair(const uint8_t* row_bytes, int64_t row, const uint8_t* row_scale,
                                    int64_t blocks, int64_t p, bool whole, const float* xd, int64_t stride,
                                    __m512 acc[ROWS]) {
  __m512 w[8];
  two_rows_steps(row_bytes, row, p, whole, w);
  const __m512 s = two_rows_scale(row_scale, blocks, p, whole);
  for (int r = 0; r < ROWS; ++r) {
    const float* xr = xd + r * stride + mxfp4_rows::kPair * p;
    __m512 partial = _mm512_mul_ps(w[0], _mm512_broadcast_f32x8(_mm256_loadu_ps(xr)));
    for (int j = 1; j < 8; ++j)
      partial = _mm512_fmadd_ps(w[j], _mm512_broadcast_f32x8(_mm256_loadu_ps(xr + 8 * j)), partial);
    acc[r] = _mm512_fmadd_ps(partial, s, acc[r]);
  }
}

// mxfp4_rows::gemv_rows<ROWS>, two weight rows per register: the same bits. The bytes kAheadBytes on are asked
// for into the L2 cache (prefetcht1), not L1 as the AVX2 kernel does: 32 K3 experts [3072, 3584] cycled, the
// caches flushed before each pass, one row, one process, EPYC Zen 4: one thread 9.3 -> 11.5-11.6 GB/s, two
// 18.4 -> 22.3-22.5 (AVX2-only CPUs not measured, so their kernel keeps T0).
template <int ROWS>
K3_AVX512 void gemv_rows_pairs(const float* xd, int64_t stride, const uint8_t* packed, const uint8_t* scale,
                               int64_t K, float* out, int64_t ldo, int64_t n_begin, int64_t n_end) {
  const int64_t blocks = K / kBlock, whole = blocks / 2, row = K / 2;
  int64_t n = n_begin;
  for (; n + 2 <= n_end; n += 2) {
    const uint8_t* row_bytes = packed + n * row;
    const uint8_t* row_scale = scale + n * blocks;
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < whole; ++p) {
      if (p % 2 == 0) {
        const uint8_t* ahead = row_bytes + p * mxfp4_rows::kPairBytes + mxfp4_rows::kAheadBytes;
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + row), _MM_HINT_T1);
      }
      two_rows_pair<ROWS>(row_bytes, row, row_scale, blocks, p, true, xd, stride, acc);
    }
    if (blocks % 2 == 1) two_rows_pair<ROWS>(row_bytes, row, row_scale, blocks, whole, false, xd, stride, acc);
    for (int r = 0; r < ROWS; ++r) {
      out[r * ldo + n] = mxfp4_rows::horizontal_sum(_mm512_castps512_ps256(acc[r]));
      out[r * ldo + n + 1] = mxfp4_rows::horizontal_sum(_mm512_extractf32x8_ps(acc[r], 1));
    }
  }
  if (n < n_end) mxfp4_rows::gemv_rows<ROWS>(xd, stride, packed, scale, K, out, ldo, n, n_end);
}

// Half scales of 16 E8M0 bytes, the values of kHalfScale built in integers: 2^(e - 128) has exponent field
// e - 1 for e = 2..254; e = 0 and 1 give the subnormals 2^-128 and 2^-127, e = 255 NaN.
K3_AVX512 inline __m512 half_scales(__m128i bytes) {
  const __m512i e = _mm512_cvtepu8_epi32(bytes);
  __m512i bits = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)),
                               _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)),
                               _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(bits);
}

// gemv_rows_pairs<1> with x's step values laid out twice (mxfp4_rows::nibble_layout, 2 copies): the FMAs read
// x from memory instead of broadcasting it, and the scales of 8 pairs (16 blocks) of each row are converted
// at once, each pair's 16 lanes picked out by one vpermt2ps. The same bits.
K3_AVX512 inline void gemv_row_twice(const float* xd, int64_t, const uint8_t* packed, const uint8_t* scale,
                                     int64_t K, float* out, int64_t, int64_t n_begin, int64_t n_end) {
  constexpr int64_t kGroup = 8;  // pairs whose scales are converted at once
  const int64_t blocks = K / kBlock, whole = blocks / 2, row = K / 2;
  const int64_t grouped = whole - whole % kGroup;  // pairs in whole groups (their scales read 16 at a time)
  const __m512i first_pair = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 16, 16, 16, 16, 17, 17, 17, 17);
  int64_t n = n_begin;
  for (; n + 2 <= n_end; n += 2) {
    const uint8_t* row_bytes = packed + n * row;
    const uint8_t* row_scale = scale + n * blocks;
    __m512 acc = _mm512_setzero_ps();
    const auto pair = [&](int64_t p, bool full, __m512 s) K3_AVX512 {
      __m512 w[8];
      two_rows_steps(row_bytes, row, p, full, w);
      const float* xp = xd + 2 * mxfp4_rows::kPair * p;
      __m512 partial = _mm512_mul_ps(w[0], _mm512_loadu_ps(xp));
      for (int j = 1; j < 8; ++j) partial = _mm512_fmadd_ps(w[j], _mm512_loadu_ps(xp + 16 * j), partial);
      acc = _mm512_fmadd_ps(partial, s, acc);
    };
    __m512 low = _mm512_setzero_ps(), high = low;
    __m512i index = first_pair;
    for (int64_t p = 0; p < whole; ++p) {
      if (p % 2 == 0) {
        const uint8_t* ahead = row_bytes + p * mxfp4_rows::kPairBytes + mxfp4_rows::kAheadBytes;
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + row), _MM_HINT_T1);
      }
      if (p >= grouped) {
        pair(p, true, two_rows_scale(row_scale, blocks, p, true));
        continue;
      }
      if (p % kGroup == 0) {
        low = half_scales(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row_scale + 2 * p)));
        high = half_scales(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row_scale + blocks + 2 * p)));
        index = first_pair;
      }
      pair(p, true, _mm512_permutex2var_ps(low, index, high));
      index = _mm512_add_epi32(index, _mm512_set1_epi32(2));
    }
    if (blocks % 2 == 1) pair(whole, false, two_rows_scale(row_scale, blocks, whole, false));
    out[n] = mxfp4_rows::horizontal_sum(_mm512_castps512_ps256(acc));
    out[n + 1] = mxfp4_rows::horizontal_sum(_mm512_extractf32x8_ps(acc, 1));
  }
  if (n < n_end) mxfp4_rows::gemv_rows<1, 2>(xd, 0, packed, scale, K, out, 0, n, n_end);
}

constexpr mxfp4_rows::GemvRowsFn kGemvRowsPairs[mxfp4_rows::kMaxRows + 1] = {
    nullptr,            gemv_rows_pairs<1>, gemv_rows_pairs<2>, gemv_rows_pairs<3>, gemv_rows_pairs<4>,
    gemv_rows_pairs<5>, gemv_rows_pairs<6>, gemv_rows_pairs<7>, gemv_rows_pairs<8>};

// How a call with B rows of x runs: at one row on AVX-512, x's step values laid out twice for gemv_row_twice;
// otherwise once, for gemv_rows_pairs (AVX-512) or mxfp4_rows::gemv_rows.
inline int copies_of_x(bool wide, int64_t B) { return wide && B == 1 ? 2 : 1; }

// x [B, K] laid out for the kernels `wide` picks (mxfp4_rows::lay_out, copies_of_x(wide, B) copies) in
// `storage`: where it starts, and the floats from one row of x to the next.
struct LaidOut {
  const float* data;
  int64_t stride;
};
inline LaidOut lay_out(const float* x, int64_t K, int64_t B, bool wide, std::vector<float>& storage) {
  const int copies = copies_of_x(wide, B);
  return {mxfp4_rows::lay_out(x, K, B, copies, storage), mxfp4_rows::nibble_stride(K, copies)};
}

// The kernel for `rows` (<= kMaxRows) rows of x of a call with B rows in all, x laid out by lay_out.
inline mxfp4_rows::GemvRowsFn kernel(bool wide, int64_t B, int64_t rows) {
  if (copies_of_x(wide, B) == 2) return gemv_row_twice;
  return wide ? kGemvRowsPairs[rows] : mxfp4_rows::kGemvRows[rows];
}

#undef K3_AVX512

}  // namespace mxfp4_rows512
