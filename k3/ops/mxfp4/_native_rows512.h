// AVX-512 versions of the MXFP4 GEMVs of _native_rows.h (one row, and the decode step's few rows): bit for
// bit their results.
//
// The AVX2 kernels run every block of 32 codes as four 8-lane groups: g = 0..3 holds elements 8g..8g+7.
// Here one 16-lane register holds group g of two consecutive blocks, b (lanes 0-7) and b+1 (lanes 8-15),
// so every lane performs exactly the operations, in the same order, that its AVX2 lane performs: AVX2
// accumulates even blocks into acc_even and odd ones into acc_odd; here lanes 0-7 are acc_even and lanes
// 8-15 acc_odd (a pair starts at an even block). The few-row kernel at 2-8 rows (`gemv_rows_pairs`) puts
// two weight rows in one register instead (measured and left out: two rows of x per register gained
// nothing; a block's 32 codes in two 16-lane registers would change the bits and lost at one row).
// `gemv_rows1` does the same for the few-row kernel at one row (gemv_rows<1>, which scales the codes before
// the products and carries one accumulator: its two blocks' sums are added in order).
// x is read in the pair-of-blocks order, so it is laid out once per call (`pair_layout`): for each
// pair p of blocks, group g, lanes [x[64p + 8g .. +8) | x[64p + 32 + 8g .. +8)]. An odd last block runs
// the AVX2 code. Decoding a pair: the 32 packed bytes and the same shifted right by 4 hold every code in
// some byte's low 4 bits; per group, one byte permutation (AVX-512 VBMI) brings element 8g+i of block b+h
// into lane 8h+i, and a lookup (vpermps) in a 16-float table of the E2M1 codes times two (+0 for code 8,
// as the AVX2 integer path gives) turns it into its value.
#pragma once

#include "_native_common.h"
#include "_native_rows.h"

#include <immintrin.h>

#include <cstdint>
#include <string>

namespace mxfp4_rows512 {

using mxfp4_rows::kBlock;
using mxfp4_rows::kBlockBytes;
using mxfp4_rows::kHalfScale;

#define K3_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi")))

inline bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vbmi");
}

// The one-row GEMV in use on this CPU: "avx512" where it has what this file needs, else "avx2".
inline std::string gemv_variant() {
  static const bool supported = cpu_supported();
  return supported ? "avx512" : "avx2";
}

// Whether the kernels `variant` asks for are this file's: "auto" (gemv_variant()), "avx2" or "avx512".
inline bool wide_variant(const std::string& variant) {
  return k3_native::wide_variant(variant, gemv_variant() == "avx512", "F/BW/DQ/VL/VBMI");
}

// E2M1 codes times two as floats, +0 for code 8 (-0): the AVX2 path converts the integer 0 to +0.
alignas(64) constexpr float kCodeTimesTwoF[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Group g's byte permutation: lane 8h + i (its low byte, 4 (8h + i)) takes the byte whose low 4 bits are
// the code of element e = 8g + i of block b + h: byte e/2 of that block, from the packed bytes (bytes 0-31
// of the source) for even e, from the packed bytes shifted right by 4 (bytes 32-63) for odd e. The other
// bytes of a lane are don't-cares: vpermps reads only an index's low 4 bits.
struct PairPermutation {
  alignas(64) uint8_t index[4][64];
  constexpr PairPermutation() : index() {
    for (int g = 0; g < 4; ++g)
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 8; ++i) {
          const int e = 8 * g + i;
          index[g][4 * (8 * h + i)] = static_cast<uint8_t>((e % 2) * 32 + 16 * h + e / 2);
        }
  }
};
inline constexpr PairPermutation kPairPermutation;

// xp[64p + 16g + 8h + i] = x[64p + 32h + 8g + i] for the blocks_even = 2 * (K/64) leading blocks; the
// rest (one odd block) is copied as is.
inline void pair_layout(const float* x, int64_t K, float* xp) {
  const int64_t pairs = K / (2 * kBlock);
  for (int64_t p = 0; p < pairs; ++p)
    for (int g = 0; g < 4; ++g)
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 8; ++i) xp[64 * p + 16 * g + 8 * h + i] = x[64 * p + 32 * h + 8 * g + i];
  for (int64_t k = pairs * 2 * kBlock; k < K; ++k) xp[k] = x[k];
}

// The 64 codes of blocks b, b+1 (32 packed bytes) as four 16-lane groups of "code times two" floats:
// one byte permutation and one 16-entry table lookup per group.
K3_AVX512 inline void decode_pair(const uint8_t* bytes, __m512 w[4]) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1);
  const __m512 table = _mm512_load_ps(kCodeTimesTwoF);
  for (int g = 0; g < 4; ++g) {
    const __m512i order = _mm512_load_si512(reinterpret_cast<const void*>(kPairPermutation.index[g]));
    w[g] = _mm512_permutexvar_ps(_mm512_permutexvar_epi8(order, both), table);
  }
}

// [half_scale(low) x 8 | half_scale(high) x 8] for two E8M0 scale bytes
K3_AVX512 inline __m512 pair_scale(uint8_t low, uint8_t high) {
  return _mm512_insertf32x8(_mm512_set1_ps(kHalfScale.value[low]), _mm256_set1_ps(kHalfScale.value[high]), 1);
}

// mxfp4_rows::gemv_one_row, x given in pair layout (xp).
K3_AVX512 inline void gemv_one_row(const float* xp, const uint8_t* packed, const uint8_t* scale, int64_t K,
                                   float* out, int64_t n_begin, int64_t n_end) {
  const int64_t blocks = K / kBlock, paired = blocks - blocks % 2;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row_bytes = packed + n * (K / 2);
    const uint8_t* row_scale = scale + n * blocks;
    __m512 acc = _mm512_setzero_ps();  // lanes 0-7: acc_even, 8-15: acc_odd
    for (int64_t b = 0; b < paired; b += 2) {
      __m512 w[4];
      decode_pair(row_bytes + b * kBlockBytes, w);
      const float* xb = xp + b * kBlock;
      __m512 left = _mm512_mul_ps(w[0], _mm512_loadu_ps(xb));
      __m512 right = _mm512_mul_ps(w[1], _mm512_loadu_ps(xb + 16));
      left = _mm512_fmadd_ps(w[2], _mm512_loadu_ps(xb + 32), left);
      right = _mm512_fmadd_ps(w[3], _mm512_loadu_ps(xb + 48), right);
      acc = _mm512_fmadd_ps(pair_scale(row_scale[b], row_scale[b + 1]), _mm512_add_ps(left, right), acc);
    }
    __m256 acc_even = _mm512_castps512_ps256(acc);
    const __m256 acc_odd = _mm512_extractf32x8_ps(acc, 1);
    if (paired < blocks) {  // the last block, even-numbered: as the AVX2 kernel runs it
      __m256 w[4];
      mxfp4_rows::decode_block(row_bytes + paired * kBlockBytes, w);
      const float* xb = xp + paired * kBlock;
      __m256 left = _mm256_mul_ps(w[0], _mm256_loadu_ps(xb));
      __m256 right = _mm256_mul_ps(w[1], _mm256_loadu_ps(xb + 8));
      left = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), left);
      right = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), right);
      const __m256 s = _mm256_set1_ps(kHalfScale.value[row_scale[paired]]);
      acc_even = _mm256_fmadd_ps(s, _mm256_add_ps(left, right), acc_even);
    }
    out[n] = mxfp4_rows::horizontal_sum(_mm256_add_ps(acc_even, acc_odd));
  }
}

// Bytes 16-31 of each half of a decode_pair source (block b+1's bytes): bit 4 names the second table of
// vpermt2ps in `decode_pair_scaled`.
struct SecondBlockBit {
  alignas(64) uint8_t bytes[64];
  constexpr SecondBlockBit() : bytes() {
    for (int i = 0; i < 64; ++i) bytes[i] = (i % 32) >= 16 ? 0x10 : 0;
  }
};
inline constexpr SecondBlockBit kSecondBlockBit;

// decode_pair's four groups already scaled: lanes 0-7 by block b's half scale, 8-15 by block b+1's. The
// table is scaled instead of the codes (two multiplications a pair, not four), and each lane looks its
// code up in the table of its block (vpermt2ps; a code's byte carries bit 4 for block b+1). Every value is
// the same exact product code_times_two * half_scale.
K3_AVX512 inline void decode_pair_scaled(const uint8_t* bytes, const uint8_t* row_scale, int64_t b, __m512 w[4]) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1);
  const __m512i second = _mm512_load_si512(reinterpret_cast<const void*>(kSecondBlockBit.bytes));
  // (raw & 0x0F) | second: each byte's code, bit 4 set in block b+1's bytes
  const __m512i both = _mm512_ternarylogic_epi32(raw, _mm512_set1_epi8(0x0F), second, 0xEA);
  const __m512 table = _mm512_load_ps(kCodeTimesTwoF);
  const __m512 first_table = _mm512_mul_ps(table, _mm512_set1_ps(kHalfScale.value[row_scale[b]]));
  const __m512 second_table = _mm512_mul_ps(table, _mm512_set1_ps(kHalfScale.value[row_scale[b + 1]]));
  for (int g = 0; g < 4; ++g) {
    const __m512i order = _mm512_load_si512(reinterpret_cast<const void*>(kPairPermutation.index[g]));
    w[g] = _mm512_permutex2var_ps(first_table, _mm512_permutexvar_epi8(order, both), second_table);
  }
}

// mxfp4_rows::gemv_rows<1> (the fused decode step's experts at one row), x given in pair layout (xp): bit
// for bit its results. Per pair of blocks the codes are decoded already scaled per block (lanes 0-7 by block
// b's scale, 8-15 by block b+1's), both blocks' partial sums formed at once in 16 lanes, and added to the one
// 8-lane accumulator as the AVX2 kernel adds them: block b's, then block b+1's.
K3_AVX512 inline void gemv_rows1(const float* xp, const uint8_t* packed, const uint8_t* scale, int64_t K,
                                 float* out, int64_t n_begin, int64_t n_end) {
  const int64_t blocks = K / kBlock, paired = blocks - blocks % 2;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row_bytes = packed + n * (K / 2);
    const uint8_t* row_scale = scale + n * blocks;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < paired; b += 2) {
      __m512 w[4];
      decode_pair_scaled(row_bytes + b * kBlockBytes, row_scale, b, w);
      const float* xb = xp + b * kBlock;
      __m512 partial = _mm512_mul_ps(w[0], _mm512_loadu_ps(xb));
      for (int g = 1; g < 4; ++g) partial = _mm512_fmadd_ps(w[g], _mm512_loadu_ps(xb + 16 * g), partial);
      acc = _mm256_add_ps(acc, _mm512_castps512_ps256(partial));
      acc = _mm256_add_ps(acc, _mm512_extractf32x8_ps(partial, 1));
    }
    if (paired < blocks) {  // the last block, as the AVX2 kernel runs it
      __m256 w[4];
      mxfp4_rows::decode_block(row_bytes + paired * kBlockBytes, w);
      const __m256 s = _mm256_set1_ps(kHalfScale.value[row_scale[paired]]);
      const float* xb = xp + paired * kBlock;
      __m256 partial = _mm256_mul_ps(_mm256_mul_ps(w[0], s), _mm256_loadu_ps(xb));
      for (int g = 1; g < 4; ++g)
        partial = _mm256_fmadd_ps(_mm256_mul_ps(w[g], s), _mm256_loadu_ps(xb + 8 * g), partial);
      acc = _mm256_add_ps(acc, partial);
    }
    out[n] = mxfp4_rows::horizontal_sum(acc);
  }
}

// mxfp4_rows::gemv_rows<ROWS> (the fused decode step's experts at 2-8 rows), two weight rows per register:
// lanes 0-7 carry weight row n and lanes 8-15 row n + 1, each lane doing what its AVX2 lane does for its
// row in the same order (the same bits), with x's 8 values broadcast to both halves. A 16-lane operation
// does two rows' work, and each load of x serves both. An odd last weight row runs the AVX2 kernel.
template <int ROWS>
K3_AVX512 void gemv_rows_pairs(const float* x, const uint8_t* packed, const uint8_t* scale, int64_t K,
                               int64_t N, float* out, int64_t n_begin, int64_t n_end) {
  const int64_t blocks = K / kBlock;
  int64_t n = n_begin;
  for (; n + 2 <= n_end; n += 2) {
    const uint8_t* bytes = packed + n * (K / 2);
    const uint8_t* scales = scale + n * blocks;
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 low[4], high[4];
      mxfp4_rows::decode_block(bytes + b * kBlockBytes, low);
      mxfp4_rows::decode_block(bytes + K / 2 + b * kBlockBytes, high);
      const __m512 s = pair_scale(scales[b], scales[blocks + b]);  // row n's block b | row n + 1's
      __m512 w[4];
      for (int i = 0; i < 4; ++i) {
        w[i] = _mm512_mul_ps(_mm512_insertf32x8(_mm512_castps256_ps512(low[i]), high[i], 1), s);
      }
      const float* xb = x + b * kBlock;
      for (int r = 0; r < ROWS; ++r) {
        const float* xr = xb + r * K;
        __m512 partial = _mm512_mul_ps(w[0], _mm512_broadcast_f32x8(_mm256_loadu_ps(xr)));
        for (int i = 1; i < 4; ++i)
          partial = _mm512_fmadd_ps(w[i], _mm512_broadcast_f32x8(_mm256_loadu_ps(xr + 8 * i)), partial);
        acc[r] = _mm512_add_ps(acc[r], partial);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      out[r * N + n] = mxfp4_rows::horizontal_sum(_mm512_castps512_ps256(acc[r]));
      out[r * N + n + 1] = mxfp4_rows::horizontal_sum(_mm512_extractf32x8_ps(acc[r], 1));
    }
  }
  if (n < n_end) mxfp4_rows::gemv_rows<ROWS>(x, packed, scale, K, N, out, n, n_end);
}

constexpr mxfp4_rows::GemvRowsFn kGemvRowsPairs[mxfp4_rows::kMaxRows + 1] = {
    nullptr,            gemv_rows_pairs<1>, gemv_rows_pairs<2>, gemv_rows_pairs<3>, gemv_rows_pairs<4>,
    gemv_rows_pairs<5>, gemv_rows_pairs<6>, gemv_rows_pairs<7>, gemv_rows_pairs<8>};

#undef K3_AVX512

}  // namespace mxfp4_rows512
