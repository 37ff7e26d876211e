// MXFP4 rows times a few vectors quantized to int8 per block of 32: the approximate mode of the expert GEMV.
//
// The exact kernels (_native_rows.h) turn every weight into an fp32 value and multiply it in fp32: on a CPU
// whose 256-bit operations are split in two (AMD Zen 1) that decoding and the FMAs bound them well below the
// memory's read rate. Here x is rounded once, per block of 32 values, to q = round(x * 127 / max|x|) with the
// block's scale max|x| / 127 (as llama.cpp's Q8_0 does, the scale kept in fp32), and each block's products
// are integers: vpmaddubsw multiplies 32 unsigned weight bytes by 32 int8 codes of x, with no conversion of
// the weights at all. The result is exactly W times the rounded x (each block's integer sum is exact, then
// scaled and summed in fp32), so its distance from the exact product is bounded by the rounding of x: at most
// sum_k |W[n, k]| * scale_x(block of k) / 2 (tests/ops/test_mxfp4_int8.py checks both).
//
// Per pair of blocks (32 packed bytes, 64 elements), with the layout of _native_rows.h:
//   even / odd  nibbles of the 32 bytes, looked up as u = code * 2 + 12 (0..24, unsigned: vpmaddubsw's
//               unsigned operand; the code times two is an integer, kCodeTimesTwo)
//   x codes     [even elements 2j | odd elements 2j + 1] of the pair, 32 int8 each, laid out once per call
//   products    vpmaddubsw(u_even, x_even) + vpmaddubsw(u_odd, x_odd): int16 i holds elements 4i .. 4i + 3
//               (|sum| <= 4 * 24 * 127, no saturation); vpmaddwd with ones: int32 lane l holds elements
//               8l .. 8l + 7 (lanes 0-3 block 2p, 4-7 block 2p + 1), minus 12 * the sum of lane l's x codes
//               (the offset that made u unsigned, precomputed with x): sum of code * 2 * q, exact
//   scale       acc_l += float(lane l) * (half_scale(weight block) * scale_x(block)): one FMA per 8 elements
//
// With AVX-512 VNNI and four or more rows of x, a 16-lane register holds two rows of x (lanes 0-7 row r, 8-15
// row r + 1) and vpdpbusd adds each lane's eight products to its int32 lane in one instruction per nibble
// half, starting from minus the lane's offset: the same integers as vpmaddubsw + vpmaddwd (exact sums in
// both), then the same scale product and FMA per lane, so every output has the AVX2 kernel's bits.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "_native_common.h"
#include "_native_rows.h"

namespace mxfp4_int8 {

using mxfp4_rows::kBlock;
using mxfp4_rows::kPair;
using mxfp4_rows::kPairBytes;

constexpr int32_t kOffset = 12;  // added to every code times two so that vpmaddubsw can take it unsigned
// E2M1 codes times two (mxfp4_rows::kCodeTimesTwo) plus kOffset: 12 13 14 15 16 18 20 24, 12 11 10 9 8 6 4 0
struct CodeOffset {
  alignas(16) uint8_t value[16];
  constexpr CodeOffset() : value{} {
    for (int c = 0; c < 16; ++c) value[c] = static_cast<uint8_t>(mxfp4_rows::kCodeTimesTwo[c] + kOffset);
  }
};
inline constexpr CodeOffset kCodeOffset;
constexpr float kLevels = 127.0f;  // x codes are in [-127, 127]
constexpr int64_t kRowBlock = 16;  // weight rows read by every group of x's rows while they are in cache

// x [B, K] rounded per block and laid out for the kernel: for row b and pair p (pairs = K / 64 rounded up),
// codes[(b pairs + p) 64 + ...] = the pair's even then odd elements, lane_scale[(b pairs + p) 8 + l] = the
// scale of lane l's block, lane_offset[...] = kOffset times the sum of lane l's eight codes. The missing block
// of an odd last pair has zero codes and a zero scale.
struct QuantizedRows {
  int64_t pairs = 0;
  std::vector<int8_t> codes;
  std::vector<float> lane_scale;
  std::vector<int32_t> lane_offset;
};

// The block's scale and codes, as k3.ops.mxfp4.int8_x.quantize_int8_blocks computes them: amax = max |x|,
// scale = amax / 127, q = round-half-even(x * (127 / amax)) in fp32 (vroundps to nearest: the same rounding;
// |q| <= 127 needs no clamp). A zero block has scale 0 and codes 0; a block with an inf or NaN has codes 0 and
// a NaN scale, so that every output it reaches is NaN.
__attribute__((target("avx2,fma"))) inline float quantize_block(const float* x, int8_t* q) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], amax = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));  // NaN lanes
  }
  const __m128 half = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  const __m128 quarter = _mm_max_ps(half, _mm_movehl_ps(half, half));
  const float top = _mm_cvtss_f32(_mm_max_ss(quarter, _mm_shuffle_ps(quarter, quarter, 1)));
  const bool finite = _mm256_movemask_ps(unordered) == 0 && std::isfinite(top);
  if (!finite || top == 0.0f) {
    std::fill(q, q + kBlock, int8_t{0});
    return finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  const __m256 inverse = _mm256_set1_ps(kLevels / top);
  alignas(32) int32_t rounded[kBlock];
  for (int i = 0; i < 4; ++i) {
    const __m256 scaled = _mm256_round_ps(_mm256_mul_ps(v[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_store_si256(reinterpret_cast<__m256i*>(rounded + 8 * i), _mm256_cvtps_epi32(scaled));
  }
  for (int64_t i = 0; i < kBlock; ++i) q[i] = static_cast<int8_t>(rounded[i]);
  return top / kLevels;
}

__attribute__((target("avx2,fma"))) inline void quantize_rows(const float* x, int64_t K, int64_t B,
                                                              QuantizedRows& out) {
  const int64_t blocks = K / kBlock;
  out.pairs = (blocks + 1) / 2;
  out.codes.assign(B * out.pairs * kPair, 0);
  out.lane_scale.assign(B * out.pairs * 8, 0.0f);
  out.lane_offset.assign(B * out.pairs * 8, 0);
  int8_t q[kBlock];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t block = 0; block < blocks; ++block) {
      const float scale = quantize_block(x + b * K + block * kBlock, q);
      const int64_t pair = b * out.pairs + block / 2, half = block % 2;  // half: bytes 16 .. 31 of the pair
      int8_t* codes = out.codes.data() + pair * kPair;
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        codes[16 * half + j] = q[2 * j];           // the low nibble of byte j of this block
        codes[32 + 16 * half + j] = q[2 * j + 1];  // its high nibble
      }
      for (int64_t l = 0; l < 4; ++l) {
        int32_t sum = 0;
        for (int64_t i = 0; i < 8; ++i) sum += q[8 * l + i];
        out.lane_scale[pair * 8 + 4 * half + l] = scale;
        out.lane_offset[pair * 8 + 4 * half + l] = kOffset * sum;
      }
    }
}

// out[r * ldo + n] = sum_k W[n, k] * xq[row0 + r, k] for r < ROWS, n in [n_begin, n_end): each pair of blocks
// looked up once for all ROWS rows of x. (Converting eight weight scales at once and spreading them with a
// lane permute instead of pair_scale's two table loads: 0.84x at one row on an AVX2-only EPYC, Zen 1.)
template <int ROWS>
__attribute__((target("avx2,fma"))) void gemv_rows(const QuantizedRows& xq, int64_t row0, const uint8_t* packed,
                                                   const uint8_t* scale, int64_t K, float* out, int64_t ldo,
                                                   int64_t n_begin, int64_t n_end) {
  const int64_t blocks = K / kBlock, whole = blocks / 2;
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kCodeOffset.value)));
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* codes = xq.codes.data() + row0 * xq.pairs * kPair;
  const float* lane_scale = xq.lane_scale.data() + row0 * xq.pairs * 8;
  const int32_t* lane_offset = xq.lane_offset.data() + row0 * xq.pairs * 8;
  const int64_t code_stride = xq.pairs * kPair, lane_stride = xq.pairs * 8;  // between rows of x
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row_bytes = packed + n * (K / 2);
    const uint8_t* row_scale = scale + n * blocks;
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t p = 0; p < xq.pairs; ++p) {
      const bool is_whole = p < whole;  // else an odd last block, as _native_rows.h reads it
      if (p % 2 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(row_bytes + p * kPairBytes + mxfp4_rows::kAheadBytes),
                     _MM_HINT_T0);
      }
      const __m256i bytes = mxfp4_rows::pair_bytes(row_bytes, p, is_whole);
      const __m256i even = _mm256_shuffle_epi8(table, _mm256_and_si256(bytes, low_mask));
      const __m256i odd = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask));
      const __m256 weight_scale = mxfp4_rows::pair_scale(row_scale, p, is_whole);
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* xc = codes + r * code_stride + p * kPair;
        const __m256i quads =
            _mm256_add_epi16(_mm256_maddubs_epi16(even, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc))),
                             _mm256_maddubs_epi16(odd, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + 32))));
        const __m256i lanes = _mm256_sub_epi32(
            _mm256_madd_epi16(quads, ones),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_offset + r * lane_stride + 8 * p)));
        const __m256 s = _mm256_mul_ps(weight_scale, _mm256_loadu_ps(lane_scale + r * lane_stride + 8 * p));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), s, acc[r]);
      }
    }
    for (int r = 0; r < ROWS; ++r) out[r * ldo + n] = mxfp4_rows::horizontal_sum(acc[r]);
  }
}

using GemvRowsFn = void (*)(const QuantizedRows&, int64_t, const uint8_t*, const uint8_t*, int64_t, float*, int64_t,
                            int64_t, int64_t);
constexpr GemvRowsFn kGemvRows[mxfp4_rows::kMaxRows + 1] = {nullptr,      gemv_rows<1>, gemv_rows<2>,
                                                             gemv_rows<3>, gemv_rows<4>, gemv_rows<5>,
                                                             gemv_rows<6>, gemv_rows<7>, gemv_rows<8>};

// out[r * ldo + n] = sum_k W[n, k] * xq[r, k] for r < B, n in [n_begin, n_end): up to kMaxRows rows of x per
// pass over W, every kRowBlock rows of W read by all the groups while they are in cache.
inline void multiply(const QuantizedRows& xq, int64_t B, const uint8_t* packed, const uint8_t* scale, int64_t K,
                     float* out, int64_t ldo, int64_t n_begin, int64_t n_end) {
  for (int64_t nb = n_begin; nb < n_end; nb += kRowBlock) {
    const int64_t ne = std::min(n_end, nb + kRowBlock);
    for (int64_t r0 = 0; r0 < B; r0 += mxfp4_rows::kMaxRows) {
      const int64_t rows = std::min<int64_t>(mxfp4_rows::kMaxRows, B - r0);
      kGemvRows[rows](xq, r0, packed, scale, K, out + r0 * ldo, ldo, nb, ne);
    }
  }
}

// ---- AVX-512 VNNI: two rows of x per register ----------------------------------------------------------

#define K3_VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vnni")))

inline bool vnni_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
}

// Rows of x from which the VNNI kernel runs (the same bits either way). One [3072, 3584] matrix of 32 cycled, 2
// threads, EPYC Zen 4, AVX2 against VNNI: 8 rows 0.95-0.99 -> 0.54-0.56 ms, 4 rows 0.47-0.52 -> 0.36, 2-3 rows
// level within the noise (0.25-0.35 ms: the weights' read bounds them).
constexpr int64_t kVnniMinRows = 4;

// Whether `variant` ("auto", "avx2", "avx512") asks for the VNNI kernel on this CPU.
inline bool vnni_variant(const std::string& variant) {
  static const bool supported = vnni_supported();
  return k3_native::wide_variant(variant, supported, "F/BW/DQ/VNNI");
}

// QuantizedRows re-laid by pairs of rows (an odd last row paired with itself): for row pair q and pair of
// blocks p, at (q pairs + p): 128 codes [row 2q's even | row 2q + 1's even | row 2q's odd | row 2q + 1's odd],
// 16 lane scales and 16 lane offsets negated [row 2q's 8 | row 2q + 1's 8].
struct RowPairs {
  int64_t pairs = 0;
  std::vector<int8_t> codes;
  std::vector<float> lane_scale;
  std::vector<int32_t> minus_offset;
};

inline void pair_rows(const QuantizedRows& xq, int64_t B, RowPairs& out) {
  const int64_t pairs = xq.pairs, row_pairs = (B + 1) / 2;
  out.pairs = pairs;
  out.codes.resize(row_pairs * pairs * 2 * kPair);
  out.lane_scale.resize(row_pairs * pairs * 16);
  out.minus_offset.resize(row_pairs * pairs * 16);
  for (int64_t q = 0; q < row_pairs; ++q)
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t r = std::min(2 * q + half, B - 1);
      for (int64_t p = 0; p < pairs; ++p) {
        const int64_t from = r * pairs + p, to = q * pairs + p;
        const int8_t* codes = xq.codes.data() + from * kPair;
        std::copy(codes, codes + kPair / 2, out.codes.data() + to * 2 * kPair + half * kPair / 2);
        std::copy(codes + kPair / 2, codes + kPair, out.codes.data() + to * 2 * kPair + kPair + half * kPair / 2);
        for (int64_t l = 0; l < 8; ++l) {
          out.lane_scale[to * 16 + 8 * half + l] = xq.lane_scale[from * 8 + l];
          out.minus_offset[to * 16 + 8 * half + l] = -xq.lane_offset[from * 8 + l];
        }
      }
    }
}

// out[r * ldo + n] for the rows r of x in row pairs q0 .. q0 + QS - 1 (r < B) and the NR weight rows n .. n + NR
// - 1: gemv_rows with a register per pair of rows of x and weight row, each pair of weight blocks looked up once
// for all the rows of x, and each row of x's codes, offsets and scales loaded once for the NR weight rows (at
// eight rows of x they are 57 kB per weight row, more than the L1 cache holds: read from L2 once per NR rows).
template <int QS, int NR>
K3_VNNI void row_pairs_tile(const RowPairs& xp, int64_t q0, int64_t B, const uint8_t* packed, const uint8_t* scale,
                            int64_t K, float* out, int64_t ldo, int64_t n) {
  const int64_t blocks = K / kBlock, whole = blocks / 2, pairs = xp.pairs;
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kCodeOffset.value)));
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  __m512 acc[NR][QS];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const bool is_whole = p < whole;
    __m512i even[NR], odd[NR];
    __m512 weight_scale[NR];
    for (int w = 0; w < NR; ++w) {
      const uint8_t* row_bytes = packed + (n + w) * (K / 2);
      if (p % 2 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(row_bytes + p * kPairBytes + mxfp4_rows::kAheadBytes),
                     _MM_HINT_T0);
      }
      const __m512i bytes = _mm512_broadcast_i64x4(mxfp4_rows::pair_bytes(row_bytes, p, is_whole));
      even[w] = _mm512_shuffle_epi8(table, _mm512_and_si512(bytes, low_mask));
      odd[w] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_mask));
      weight_scale[w] = _mm512_broadcast_f32x8(mxfp4_rows::pair_scale(scale + (n + w) * blocks, p, is_whole));
    }
    for (int q = 0; q < QS; ++q) {
      const int64_t at = (q0 + q) * pairs + p;
      const int8_t* xc = xp.codes.data() + at * 2 * kPair;
      const __m512i x_even = _mm512_loadu_si512(xc), x_odd = _mm512_loadu_si512(xc + kPair);
      const __m512i minus_offset = _mm512_loadu_si512(xp.minus_offset.data() + at * 16);
      const __m512 x_scale = _mm512_loadu_ps(xp.lane_scale.data() + at * 16);
      for (int w = 0; w < NR; ++w) {
        const __m512i lanes =
            _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(minus_offset, even[w], x_even), odd[w], x_odd);
        const __m512 s = _mm512_mul_ps(weight_scale[w], x_scale);
        acc[w][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), s, acc[w][q]);
      }
    }
  }
  for (int w = 0; w < NR; ++w)
    for (int q = 0; q < QS; ++q) {
      const int64_t r = 2 * (q0 + q);
      out[r * ldo + n + w] = mxfp4_rows::horizontal_sum(_mm512_castps512_ps256(acc[w][q]));
      if (r + 1 < B) out[(r + 1) * ldo + n + w] = mxfp4_rows::horizontal_sum(_mm512_extractf32x8_ps(acc[w][q], 1));
    }
}

// Weight rows [n_begin, n_end) by row_pairs_tile: kTileRows at a time, then one by one.
template <int QS>
void gemv_row_pairs(const RowPairs& xp, int64_t q0, int64_t B, const uint8_t* packed, const uint8_t* scale, int64_t K,
                    float* out, int64_t ldo, int64_t n_begin, int64_t n_end) {
  constexpr int kTileRows = 4;
  int64_t n = n_begin;
  for (; n + kTileRows <= n_end; n += kTileRows)
    row_pairs_tile<QS, kTileRows>(xp, q0, B, packed, scale, K, out, ldo, n);
  for (; n < n_end; ++n) row_pairs_tile<QS, 1>(xp, q0, B, packed, scale, K, out, ldo, n);
}

using GemvRowPairsFn = void (*)(const RowPairs&, int64_t, int64_t, const uint8_t*, const uint8_t*, int64_t, float*,
                                int64_t, int64_t, int64_t);
constexpr int kMaxRowPairs = mxfp4_rows::kMaxRows / 2;
constexpr GemvRowPairsFn kGemvRowPairs[kMaxRowPairs + 1] = {nullptr, gemv_row_pairs<1>, gemv_row_pairs<2>,
                                                            gemv_row_pairs<3>, gemv_row_pairs<4>};

// `multiply` with the VNNI kernel on x's B rows laid out by pair_rows: up to kMaxRows rows per pass over W.
inline void multiply_row_pairs(const RowPairs& xp, int64_t B, const uint8_t* packed, const uint8_t* scale,
                               int64_t K, float* out, int64_t ldo, int64_t n_begin, int64_t n_end) {
  const int64_t row_pairs = (B + 1) / 2;
  for (int64_t nb = n_begin; nb < n_end; nb += kRowBlock) {
    const int64_t ne = std::min(n_end, nb + kRowBlock);
    for (int64_t q0 = 0; q0 < row_pairs; q0 += kMaxRowPairs) {
      const int64_t qs = std::min<int64_t>(kMaxRowPairs, row_pairs - q0);
      kGemvRowPairs[qs](xp, q0, B, packed, scale, K, out, ldo, nb, ne);
    }
  }
}

// x [B, K] rounded and laid out for the kernel that multiplies it: the VNNI one where `vnni` allows it and B is
// at least kVnniMinRows (the same bits either way), else the AVX2 one.
struct RoundedRows {
  QuantizedRows rows;
  RowPairs pairs;  // for the VNNI kernel only
  bool vnni = false;
};

inline void round_rows(const float* x, int64_t K, int64_t B, bool vnni, RoundedRows& out) {
  quantize_rows(x, K, B, out.rows);
  out.vnni = vnni && B >= kVnniMinRows;
  if (out.vnni) pair_rows(out.rows, B, out.pairs);
}

// out[r * ldo + n] = sum_k W[n, k] * x[r, k] for r < B, n in [n_begin, n_end), by the kernel x was laid out for.
inline void multiply(const RoundedRows& x, int64_t B, const uint8_t* packed, const uint8_t* scale, int64_t K,
                     float* out, int64_t ldo, int64_t n_begin, int64_t n_end) {
  if (x.vnni) return multiply_row_pairs(x.pairs, B, packed, scale, K, out, ldo, n_begin, n_end);
  multiply(x.rows, B, packed, scale, K, out, ldo, n_begin, n_end);
}

// `multiply` on x [B, K] as given, rounded here into this thread's scratch.
inline void rows_product(const float* x, int64_t B, const uint8_t* packed, const uint8_t* scale, int64_t K,
                         float* out, int64_t ldo, int64_t n_begin, int64_t n_end, bool vnni) {
  thread_local RoundedRows rounded;
  round_rows(x, K, B, vnni, rounded);
  multiply(rounded, B, packed, scale, K, out, ldo, n_begin, n_end);
}

}  // namespace mxfp4_int8
