// MXFP4 rows times a few vectors quantized to int8 per block of 32: the approximate mode of the expert GEMV.
//
// The exact kernels (_native_rows.h) turn every weight into an fp32 value and multiply it in fp32: on a CPU
// whose 256-bit operations are split in two (AMD Zen 1) that decoding and the FMAs bound them well below the
// memory's read rate. Here x is rounded once, per block of 32 values, to q = round(x * 127 / max|x|) with the
// block's scale max|x| / 127 (as llama.cpp's Q8_0 does, the scale kept in fp32), and each block's products
// are integers: the weight bytes multiply int8 codes of x with no conversion of the weights at all. The
// result is exactly W times the rounded x (each block's integer sum is exact, then scaled and summed in
// fp32), so its distance from the exact product is bounded by the rounding of x: at most
// sum_k |W[n, k]| * scale_x(block of k) / 2 (tests/ops/test_mxfp4_int8.py checks both).
//
// One lane, one block. W is read by groups of 16 blocks (256 packed bytes, 512 elements; a row's last group
// may hold fewer). The group's four 64-byte lines hold four blocks each, one per 128-bit lane; a 4 x 4
// transpose of their 32-bit words (eight unpacks) gives four registers whose 32-bit lane L holds bytes
// 4s .. 4s + 3 (register s) of block kLaneBlock[L] = 4 (L % 4) + L / 4. Their nibbles, looked up as
// u = code * 2 + 12 (0..24, unsigned; the code times two is an integer, kCodeTimesTwo), are elements
// 8s + 2i (low nibble of byte i) and 8s + 2i + 1 (high) of that block. x is laid out once per call in the same
// order (`lay_out_rows`), so that eight byte dot products per lane (vpdpbusd: four products a lane an
// instruction; AVX2: vpmaddubsw + vpmaddwd) give block kLaneBlock[L]'s whole sum of u * q, exact in int32;
// from it the lane takes 12 * the block's sum of x codes (the offset that made u unsigned, laid out with x):
// sum code * 2 * q, exact. Then one conversion, one product of the two scales and one FMA per block:
//   acc_L += float(sum) * (half_scale(weight block) * scale_x(block))
// and the output is the sum of the 16 lanes (the upper eight added to the lower, then horizontal_sum). The
// AVX2 kernel does the same per lane in two 8-lane halves, so both give the same bits, at any number of rows
// of x and threads.
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

#define K3_AVX2 __attribute__((target("avx2,fma")))

namespace mxfp4_int8 {

using mxfp4_rows::kBlock;

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

// The block's scale and codes, as k3.ops.mxfp4.int8_x.quantize_int8_blocks computes them: amax = max |x|,
// scale = amax / 127, q = round-half-even(x * (127 / amax)) in fp32 (vroundps to nearest: the same rounding;
// |q| <= 127 needs no clamp). A zero block has scale 0 and codes 0; a block with an inf or NaN has codes 0 and
// a NaN scale, so that every output it reaches is NaN.
K3_AVX2 inline float quantize_block(const float* x, int8_t* q) {
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

constexpr int64_t kGroupBlocks = 16;                                     // blocks of W per group: a lane each
constexpr int64_t kGroupBytes = kGroupBlocks * mxfp4_rows::kBlockBytes;  // 256
constexpr int kSteps = 4;                   // registers of weight bytes per group, 4 bytes of each block
constexpr int kCodeRegisters = 2 * kSteps;  // their low and high nibbles

// kLaneBlock[L]: the block of its group that lane L carries (the word transpose's order; its own inverse).
struct LaneBlock {
  alignas(16) uint8_t value[16];
  constexpr LaneBlock() : value{} {
    for (int lane = 0; lane < 16; ++lane) value[lane] = static_cast<uint8_t>(4 * (lane % 4) + lane / 4);
  }
};
inline constexpr LaneBlock kLaneBlock;

// One group of one row of x in the kernels' order: codes[2s + h][4L + i] = q[block kLaneBlock[L]][8s + 2i +
// h], lane L's scale and minus 12 times the sum of its block's codes. Blocks past K are zeros.
struct alignas(64) LaneGroup {
  int8_t codes[kCodeRegisters][64];
  float scale[16];
  int32_t minus_offset[16];
};

// x [B, K] rounded per block and laid out: group g of row b at groups[b * per_row + g].
struct LaidOutRows {
  int64_t per_row = 0;
  std::vector<LaneGroup> groups;
  const LaneGroup* row(int64_t b) const { return groups.data() + b * per_row; }
};

inline int64_t groups_of(int64_t K) { return (K / kBlock + kGroupBlocks - 1) / kGroupBlocks; }

K3_AVX2 inline void lay_out_rows(const float* x, int64_t K, int64_t B, LaidOutRows& out) {
  const int64_t blocks = K / kBlock;
  out.per_row = groups_of(K);
  out.groups.assign(B * out.per_row, LaneGroup{});
  int8_t q[kBlock];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t block = 0; block < blocks; ++block) {
      const float scale = quantize_block(x + b * K + block * kBlock, q);
      LaneGroup& group = out.groups[b * out.per_row + block / kGroupBlocks];
      const int lane = kLaneBlock.value[block % kGroupBlocks];
      int32_t sum = 0;
      for (int s = 0; s < kSteps; ++s)
        for (int i = 0; i < 4; ++i)
          for (int h = 0; h < 2; ++h) {
            const int8_t code = q[8 * s + 2 * i + h];
            group.codes[2 * s + h][4 * lane + i] = code;
            sum += code;
          }
      group.scale[lane] = scale;
      group.minus_offset[lane] = -kOffset * sum;
    }
}

// Blocks of group g of a row with `blocks` blocks.
inline int64_t blocks_in(int64_t g, int64_t blocks) { return std::min(kGroupBlocks, blocks - g * kGroupBlocks); }

// The order in which a kernel visits the groups of a block of weight rows [n_begin, n_end) (at most kRowBlock).
// From kGroupsFirstRows rows of x, group by group: all the block's rows for one group before the next, so that
// the group of x's rows (ROWS x 640 bytes) stays in L1 while each weight row reads it (all of x's groups at eight
// rows and K = 3584 are 36 kB, more than L1 holds: row by row took 0.56 ms a [3072, 3584] matrix, group by group
// 0.41-0.42; 32 cycled, 2 threads, EPYC Zen 4), each group's lines asked for a block of rows ahead (without:
// 0.43 ms at eight rows, 0.97-1.28 for the AVX2 kernel at four and eight). With fewer rows, row by row, each
// row's bytes one stream that the hardware's prefetcher follows alone (at one row 0.17-0.19 ms, against
// 0.19-0.22 asking 8 kB ahead into L1 and 0.28-0.30 group by group, alternated), except on Zen 3
// (k3_native::cpu_is_zen3), where it left a core waiting on memory (44 cycled, one row: 12.0-12.2 GB/s at 1
// thread, 18.8 at 2), so each group there asks for its lines and every fourth group for its scales' line 2 kB
// ahead into L2 (13.4-13.8 and 20.3 GB/s; 1 or 4 kB less). Either way each (weight row, row of x) adds its
// groups in order: the same bits.
constexpr int kGroupsFirstRows = 4;
constexpr int64_t kRowAheadBytes = 2048;
struct VisitOrder {
  bool groups_first, rows_ahead;
  int64_t n_begin, outer, inner, ahead;
  VisitOrder(int rows, int64_t groups, int64_t n_begin, int64_t n_end, int64_t K)
      : groups_first(rows >= kGroupsFirstRows), rows_ahead(!groups_first && k3_native::cpu_is_zen3()),
        n_begin(n_begin),
        outer(groups_first ? groups : n_end - n_begin), inner(groups_first ? n_end - n_begin : groups),
        ahead(kRowBlock * (K / 2)) {}
  int64_t group(int64_t o, int64_t i) const { return groups_first ? o : i; }
  int64_t row(int64_t o, int64_t i) const { return n_begin + (groups_first ? i : o); }
  // Asks for lines ahead of group g (its four lines at `bytes`, its scales at `scale_bytes`): group by group,
  // the next block's same group into L1; row by row on Zen 3, kRowAheadBytes further on into L2. Always inlined:
  // a call the compiler left made the AVX2 kernel keep its registers in memory (2-3x slower at 2-8 rows).
  [[gnu::always_inline]] inline void ask_ahead(const uint8_t* bytes, const uint8_t* scale_bytes, int64_t g) const {
    if (groups_first) {
      for (int k = 0; k < kSteps; ++k) _mm_prefetch(reinterpret_cast<const char*>(bytes + 64 * k + ahead), _MM_HINT_T0);
      return;
    }
    if (!rows_ahead) return;
    for (int k = 0; k < kSteps; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(bytes + 64 * k + kRowAheadBytes), _MM_HINT_T1);
    }
    if (g % 4 == 0) {  // a 64-byte line holds four groups' scales
      _mm_prefetch(reinterpret_cast<const char*>(scale_bytes + kRowAheadBytes / mxfp4_rows::kBlockBytes), _MM_HINT_T1);
    }
  }
};

// ---- AVX2: the group in two 8-lane halves ----------------------------------------------------------------

// Half scales 2^(s - 128) (mxfp4_rows::kHalfScale: s = 0 a subnormal, 255 NaN) of eight scale bytes (the low
// eight of `bytes`), as fp32 lanes: 2^(s - 127) built from its exponent bits, halved (exact), s = 0 and 255
// set apart.
K3_AVX2 inline __m256 eight_half_scales(__m128i bytes) {
  const __m256i s = _mm256_cvtepu8_epi32(bytes);
  const __m256 halved = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(s, 23)), _mm256_set1_ps(0.5f));
  const __m256 low = _mm256_blendv_ps(halved, _mm256_set1_ps(mxfp4_rows::kHalfScale.value[0]),
                                      _mm256_castsi256_ps(_mm256_cmpeq_epi32(s, _mm256_setzero_si256())));
  return _mm256_blendv_ps(low, _mm256_set1_ps(mxfp4_rows::kHalfScale.value[255]),
                          _mm256_castsi256_ps(_mm256_cmpeq_epi32(s, _mm256_set1_epi32(255))));
}

// Half `half` (lanes 8 half .. 8 half + 7) of a whole group's weights: codes[2s + h] as u, and the scales.
K3_AVX2 inline void group_half(const uint8_t* bytes, const uint8_t* scale_bytes, int half, __m256i codes[8],
                               __m256& weight_scale) {
  const __m256i table =
      _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kCodeOffset.value)));
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  __m256i a[kSteps];
  for (int k = 0; k < kSteps; ++k)
    a[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 64 * k + 32 * half));
  const __m256i t01l = _mm256_unpacklo_epi32(a[0], a[1]), t01h = _mm256_unpackhi_epi32(a[0], a[1]);
  const __m256i t23l = _mm256_unpacklo_epi32(a[2], a[3]), t23h = _mm256_unpackhi_epi32(a[2], a[3]);
  const __m256i t[kSteps] = {_mm256_unpacklo_epi64(t01l, t23l), _mm256_unpackhi_epi64(t01l, t23l),
                             _mm256_unpacklo_epi64(t01h, t23h), _mm256_unpackhi_epi64(t01h, t23h)};
  for (int s = 0; s < kSteps; ++s) {
    codes[2 * s] = _mm256_shuffle_epi8(table, _mm256_and_si256(t[s], low_mask));
    codes[2 * s + 1] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(t[s], 4), low_mask));
  }
  const __m128i ordered = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale_bytes)),
                                           _mm_load_si128(reinterpret_cast<const __m128i*>(kLaneBlock.value)));
  weight_scale = eight_half_scales(half == 0 ? ordered : _mm_srli_si128(ordered, 8));
}

// out[r * ldo + n] = sum_k W[n, k] * x[row0 + r, k] for r < ROWS and the weight rows [n_begin, n_end) (at most
// kRowBlock), in VisitOrder's order: each group's weights decoded once for all ROWS rows of x, a half at a time,
// the accumulators kept in `acc` between a row's groups. A row's last group, if it has fewer than 16 blocks, is
// read from a zero-padded copy (zero codes against zero x codes and scales add exact zeros).
template <int ROWS>
K3_AVX2 void avx2_rows(const LaidOutRows& x, int64_t row0, const uint8_t* packed, const uint8_t* scale, int64_t K,
                       float* out, int64_t ldo, int64_t n_begin, int64_t n_end) {
  const int64_t blocks = K / kBlock, groups = x.per_row, last = blocks_in(groups - 1, blocks);
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(64) uint8_t last_bytes[kGroupBytes], last_scale[16];
  __m256 acc[kRowBlock][2][ROWS];
  for (int64_t n = n_begin; n < n_end; ++n)
    for (auto& half : acc[n - n_begin])
      for (auto& a : half) a = _mm256_setzero_ps();
  const VisitOrder order(ROWS, groups, n_begin, n_end, K);
  for (int64_t o = 0; o < order.outer; ++o)
    for (int64_t i = 0; i < order.inner; ++i) {
      const int64_t g = order.group(o, i), n = order.row(o, i);
      const uint8_t* bytes = packed + n * (K / 2) + g * kGroupBytes;
      const uint8_t* scale_bytes = scale + n * blocks + g * kGroupBlocks;
      order.ask_ahead(bytes, scale_bytes, g);
      if (g == groups - 1 && last < kGroupBlocks) {
        std::fill(last_bytes, last_bytes + kGroupBytes, uint8_t{0});
        std::fill(last_scale, last_scale + 16, uint8_t{0});
        std::copy_n(bytes, last * mxfp4_rows::kBlockBytes, last_bytes);
        std::copy_n(scale_bytes, last, last_scale);
        bytes = last_bytes;
        scale_bytes = last_scale;
      }
      for (int half = 0; half < 2; ++half) {
        __m256i codes[kCodeRegisters];
        __m256 weight_scale;
        group_half(bytes, scale_bytes, half, codes, weight_scale);
        for (int r = 0; r < ROWS; ++r) {
          const LaneGroup& xg = x.row(row0 + r)[g];
          __m256i sum = _mm256_load_si256(reinterpret_cast<const __m256i*>(xg.minus_offset + 8 * half));
          for (int s = 0; s < kSteps; ++s) {  // |int16| <= 2 * 2 * 24 * 127: no saturation
            const auto* low = reinterpret_cast<const __m256i*>(xg.codes[2 * s] + 32 * half);
            const auto* high = reinterpret_cast<const __m256i*>(xg.codes[2 * s + 1] + 32 * half);
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(codes[2 * s], _mm256_load_si256(low)),
                                                   _mm256_maddubs_epi16(codes[2 * s + 1], _mm256_load_si256(high)));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
          }
          const __m256 s = _mm256_mul_ps(weight_scale, _mm256_load_ps(xg.scale + 8 * half));
          __m256& a = acc[n - n_begin][half][r];
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), s, a);
        }
      }
    }
  for (int64_t n = n_begin; n < n_end; ++n)
    for (int r = 0; r < ROWS; ++r)
      out[r * ldo + n] = mxfp4_rows::horizontal_sum(_mm256_add_ps(acc[n - n_begin][0][r], acc[n - n_begin][1][r]));
}

// ---- AVX-512 VNNI: the whole group in one register ----------------------------------------------------------

#define K3_VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

inline bool vnni_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}

// eight_half_scales for sixteen scale bytes.
K3_VNNI inline __m512 sixteen_half_scales(__m128i bytes) {
  const __m512i s = _mm512_cvtepu8_epi32(bytes);
  __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(s, 23)), _mm512_set1_ps(0.5f));
  value = _mm512_mask_mov_ps(value, _mm512_cmpeq_epi32_mask(s, _mm512_setzero_si512()),
                             _mm512_set1_ps(mxfp4_rows::kHalfScale.value[0]));
  return _mm512_mask_mov_ps(value, _mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(255)),
                            _mm512_set1_ps(mxfp4_rows::kHalfScale.value[255]));
}

// Group g's weights as codes[2s + h] (u) and lane scales; a group of fewer than 16 blocks is read with masked
// loads (zeros past its blocks).
K3_VNNI inline void group_codes(const uint8_t* bytes, const uint8_t* scale_bytes, int64_t in_group, __m512i codes[8],
                                __m512& weight_scale) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kCodeOffset.value)));
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  __m512i a[kSteps];
  __m128i scale16;
  if (in_group == kGroupBlocks) {
    for (int k = 0; k < kSteps; ++k) a[k] = _mm512_loadu_si512(bytes + 64 * k);
    scale16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scale_bytes));
  } else {
    const int64_t valid = in_group * mxfp4_rows::kBlockBytes;
    for (int k = 0; k < kSteps; ++k) {
      const int64_t here = std::clamp<int64_t>(valid - 64 * k, 0, 64);
      a[k] = _mm512_maskz_loadu_epi8(here == 64 ? ~__mmask64{0} : (__mmask64{1} << here) - 1, bytes + 64 * k);
    }
    scale16 = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << in_group) - 1), scale_bytes);
  }
  const __m512i t01l = _mm512_unpacklo_epi32(a[0], a[1]), t01h = _mm512_unpackhi_epi32(a[0], a[1]);
  const __m512i t23l = _mm512_unpacklo_epi32(a[2], a[3]), t23h = _mm512_unpackhi_epi32(a[2], a[3]);
  const __m512i t[kSteps] = {_mm512_unpacklo_epi64(t01l, t23l), _mm512_unpackhi_epi64(t01l, t23l),
                             _mm512_unpacklo_epi64(t01h, t23h), _mm512_unpackhi_epi64(t01h, t23h)};
  for (int s = 0; s < kSteps; ++s) {
    codes[2 * s] = _mm512_shuffle_epi8(table, _mm512_and_si512(t[s], low_mask));
    codes[2 * s + 1] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(t[s], 4), low_mask));
  }
  const __m128i lane_block = _mm_load_si128(reinterpret_cast<const __m128i*>(kLaneBlock.value));
  weight_scale = sixteen_half_scales(_mm_shuffle_epi8(scale16, lane_block));
}

// avx2_rows with the whole group in one register: eight vpdpbusd a block, from minus the lane's offset.
template <int ROWS>
K3_VNNI void vnni_rows(const LaidOutRows& x, int64_t row0, const uint8_t* packed, const uint8_t* scale, int64_t K,
                       float* out, int64_t ldo, int64_t n_begin, int64_t n_end) {
  const int64_t blocks = K / kBlock, groups = x.per_row;
  __m512 acc[kRowBlock][ROWS];
  for (int64_t n = n_begin; n < n_end; ++n)
    for (auto& a : acc[n - n_begin]) a = _mm512_setzero_ps();
  const VisitOrder order(ROWS, groups, n_begin, n_end, K);
  for (int64_t o = 0; o < order.outer; ++o)
    for (int64_t i = 0; i < order.inner; ++i) {
      const int64_t g = order.group(o, i), n = order.row(o, i);
      const uint8_t* bytes = packed + n * (K / 2) + g * kGroupBytes;
      const uint8_t* scale_bytes = scale + n * blocks + g * kGroupBlocks;
      order.ask_ahead(bytes, scale_bytes, g);
      __m512i codes[kCodeRegisters];
      __m512 weight_scale;
      group_codes(bytes, scale_bytes, blocks_in(g, blocks), codes, weight_scale);
      // sum[h][r]: row r's eight dot products in kSplit interleaved chains, so that a row alone does not wait on
      // one vpdpbusd after another (one hot [1024, 3584] matrix, one thread: 63-64 us against 66-85 in one
      // chain); integers, so the split changes nothing.
      constexpr int kSplit = ROWS >= 4 ? 1 : 4 / ROWS;
      __m512i sum[kSplit][ROWS];
      for (int r = 0; r < ROWS; ++r) {
        sum[0][r] = _mm512_load_si512(x.row(row0 + r)[g].minus_offset);
        for (int h = 1; h < kSplit; ++h) sum[h][r] = _mm512_setzero_si512();
      }
      for (int c = 0; c < kCodeRegisters; ++c)
        for (int r = 0; r < ROWS; ++r)
          sum[c % kSplit][r] =
              _mm512_dpbusd_epi32(sum[c % kSplit][r], codes[c], _mm512_load_si512(x.row(row0 + r)[g].codes[c]));
      for (int r = 0; r < ROWS; ++r) {
        __m512i total = sum[0][r];
        for (int h = 1; h < kSplit; ++h) total = _mm512_add_epi32(total, sum[h][r]);
        const __m512 s = _mm512_mul_ps(weight_scale, _mm512_load_ps(x.row(row0 + r)[g].scale));
        __m512& a = acc[n - n_begin][r];
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), s, a);
      }
    }
  for (int64_t n = n_begin; n < n_end; ++n)
    for (int r = 0; r < ROWS; ++r)
      out[r * ldo + n] = mxfp4_rows::horizontal_sum(
          _mm256_add_ps(_mm512_castps512_ps256(acc[n - n_begin][r]), _mm512_extractf32x8_ps(acc[n - n_begin][r], 1)));
}

// vnni_supported, asked once.
inline bool vnni_here() {
  static const bool supported = vnni_supported();
  return supported;
}

// Whether `variant` ("auto", "avx2", "avx512") asks for the VNNI kernel on this CPU.
inline bool vnni_variant(const std::string& variant) {
  return k3_native::wide_variant(variant, vnni_here(), "F/BW/DQ/VL/VNNI");
}

using RowsFn = void (*)(const LaidOutRows&, int64_t, const uint8_t*, const uint8_t*, int64_t, float*, int64_t,
                        int64_t, int64_t);
constexpr RowsFn kAvx2Rows[mxfp4_rows::kMaxRows + 1] = {nullptr,       avx2_rows<1>, avx2_rows<2>,
                                                        avx2_rows<3>,  avx2_rows<4>, avx2_rows<5>,
                                                        avx2_rows<6>,  avx2_rows<7>, avx2_rows<8>};
constexpr RowsFn kVnniRows[mxfp4_rows::kMaxRows + 1] = {nullptr,       vnni_rows<1>, vnni_rows<2>,
                                                        vnni_rows<3>,  vnni_rows<4>, vnni_rows<5>,
                                                        vnni_rows<6>,  vnni_rows<7>, vnni_rows<8>};

// out[r * ldo + n] = sum_k W[n, k] * x[r, k] for r < B, n in [n_begin, n_end), x laid out by lay_out_rows:
// up to kMaxRows rows of x per pass over W, every kRowBlock rows of W read by all the groups of rows while they
// are in cache; by the VNNI kernel where `vnni` allows it (the same bits either way), else the AVX2 one.
inline void multiply(const LaidOutRows& x, int64_t B, const uint8_t* packed, const uint8_t* scale, int64_t K,
                     float* out, int64_t ldo, int64_t n_begin, int64_t n_end, bool vnni) {
  const RowsFn* kernels = vnni ? kVnniRows : kAvx2Rows;
  for (int64_t nb = n_begin; nb < n_end; nb += kRowBlock) {
    const int64_t ne = std::min(n_end, nb + kRowBlock);
    for (int64_t r0 = 0; r0 < B; r0 += mxfp4_rows::kMaxRows) {
      const int64_t rows = std::min<int64_t>(mxfp4_rows::kMaxRows, B - r0);
      kernels[rows](x, r0, packed, scale, K, out + r0 * ldo, ldo, nb, ne);
    }
  }
}

// `multiply` on x [B, K] as given, rounded and laid out here into this thread's scratch.
inline void rows_product(const float* x, int64_t B, const uint8_t* packed, const uint8_t* scale, int64_t K,
                         float* out, int64_t ldo, int64_t n_begin, int64_t n_end, bool vnni) {
  thread_local LaidOutRows laid_out;
  lay_out_rows(x, K, B, laid_out);
  multiply(laid_out, B, packed, scale, K, out, ldo, n_begin, n_end, vnni);
}

#undef K3_VNNI
#undef K3_AVX2

}  // namespace mxfp4_int8
