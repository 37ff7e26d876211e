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
#include <cstring>
#include <limits>
#include <vector>

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

// The few-row GEMV (decode: one to kMaxRows rows of x per pass over W) reads W one pair of blocks at a time:
// 32 packed bytes as eight 32-bit words. Lane l of an 8-lane vector takes word l (elements 8l..8l+7 of the
// pair, all in block l/4), and step j takes nibble j of every word (element 8l + j): for the AVX-512 kernels
// a shift of the words and a table lookup, for the AVX2 one (decode_pair) one byte shuffle of the pair first,
// then lookups and unpacks. Per row of x and pair of blocks, lane l forms partial = w_0 x_0 + ... + w_7 x_7
// (a multiply, then seven FMAs, the codes times two unscaled) and carries acc = partial * half_scale(its
// block) + acc (one FMA); the output is acc's lanes summed
// (horizontal_sum). The AVX-512 kernels (_native_rows512.h) run two weight rows per register, each lane doing
// exactly this, so every CPU gives the same bits, at any number of rows of x (a row's result does not depend
// on its batch) and threads. An odd last block runs as a pair whose second block is zero codes against zero
// x, with its own scale in all eight lanes. Each step asks for the weight bytes kAheadBytes further on: one
// core's hardware prefetch alone left the kernel waiting on memory (measured: 8 KB ahead took one thread from
// 9 to 17-19 GB/s on 44 experts cycled, AMD EPYC Zen 5).
constexpr int64_t kPair = 2 * kBlock;            // elements per pair of blocks
constexpr int64_t kPairBytes = 2 * kBlockBytes;  // packed bytes per pair
constexpr int64_t kAheadBytes = 8192;

// Floats per row of x in the kernels' order (`nibble_layout`): K rounded up to a whole pair of blocks, times
// the copies of each step's values (2 for the AVX-512 kernel at one row, _native_rows512.h; else 1).
inline int64_t nibble_stride(int64_t K, int copies = 1) { return (K + kPair - 1) / kPair * kPair * copies; }

// The steps' weights come out of the decoders as the codes times two themselves (the AVX2 decoder builds
// their fp32 patterns, the AVX-512 one looks them up in mxfp4_rows512::kCodeTimesTwoF), and x is laid out
// as it is. Until 2026-12-05 the steps were the codes times 2^24 against x times 2^-24 (from a decoder that
// converted codes placed in each word's top byte): the same products for every |x| >= 2^-102, but smaller
// values of x became subnormal in the layout, and an FMA on a subnormal operand is slow on AMD Zen 3: a
// K3 down-projection (w2 [3584, 3072]) took 1.13 ms instead of 0.76 (one thread) on the SiTU activations
// of `k3-slice`'s random gates, 125 of whose 3,072 values were below 2^-102 (none below 2^-126).

// x [B, K] in the kernels' order: row b at xd + b * nibble_stride(K, copies), pair p, step j holds
// x[b, 64p + 8l + j] at lanes l = 0..7, `copies` times over (xd[copies (64p + 8j) + 8c + l]); 0 past K
// (the missing block of an odd last pair).
inline void nibble_layout(const float* x, int64_t K, int64_t B, int copies, float* xd) {
  const int64_t stride = nibble_stride(K, copies);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < stride / (kPair * copies); ++p)
      for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 8; ++l) {
          const int64_t k = kPair * p + 8 * l + j;
          const float value = k < K ? x[b * K + k] : 0.0f;
          for (int c = 0; c < copies; ++c) xd[b * stride + copies * (kPair * p + 8 * j) + 8 * c + l] = value;
        }
}

// x [B, K] in the kernels' order in `storage`, starting at a 64-byte boundary (so that no step's load
// straddles two cache lines: measured 1.25x for the AVX2 kernel at eight rows); returns where it starts.
inline const float* lay_out(const float* x, int64_t K, int64_t B, int copies, std::vector<float>& storage) {
  constexpr int64_t kLine = 64 / sizeof(float);
  storage.resize(B * nibble_stride(K, copies) + kLine);
  float* xd = storage.data();
  xd += (kLine - reinterpret_cast<uintptr_t>(xd) / sizeof(float) % kLine) % kLine;
  nibble_layout(x, K, B, copies, xd);
  return xd;
}

// The fp32 patterns of the codes times two: at most two significant bits, so the low 16 bits of each are
// zero and its top two bytes (a bf16) are the whole value; split into their high and low bytes for two byte
// lookups. Code 8 (-0) is +0, as converting the integer code gives it.
struct StepBytes {
  alignas(16) uint8_t high[16];
  alignas(16) uint8_t low[16];
  StepBytes() {
    for (int c = 0; c < 16; ++c) {
      const float value = static_cast<float>(kCodeTimesTwo[c]);
      uint32_t bits;
      std::memcpy(&bits, &value, sizeof bits);
      high[c] = static_cast<uint8_t>(bits >> 24);
      low[c] = static_cast<uint8_t>(bits >> 16);
    }
  }
};
inline const StepBytes kStepBytes;

// Where decode_pair's first byte shuffle takes each byte of a 16-byte half from: byte q of word k (4k + q)
// goes to 8 (q / 2) + 2k + q % 2, where the unpacks below deliver it to lane k of step 2q + t.
struct PairOrder {
  alignas(16) uint8_t source[16];
  constexpr PairOrder() : source{} {
    for (int q = 0; q < 4; ++q)
      for (int k = 0; k < 4; ++k) source[8 * (q / 2) + 2 * k + q % 2] = static_cast<uint8_t>(4 * k + q);
  }
};
inline constexpr PairOrder kPairOrder;

// The 32 bytes of a pair of blocks as the eight steps w[j] (lane l: element 8l + j times two),
// built as fp32 bit patterns with no int -> float conversion (those conversions bounded this kernel on an
// AVX2-only AMD EPYC, one of its 256-bit pipes doing them all). Element 8l + 2q + t is nibble t of byte q of
// word l. The bytes are first reordered within each 16-byte half (kPairOrder); each nibble is looked up as
// the high and the low byte of its value's pattern (kStepBytes), the two interleaved into 16-bit halves
// (unpack), and each half moved to the top of its 32-bit lane with the other cleared (a shift for q = 0, 2,
// an AND for q = 1, 3): the fp32 value itself, the same as converting the int8 code.
__attribute__((target("avx2,fma"))) inline void decode_pair(__m256i bytes, __m256 w[8]) {
  const auto table = [](const uint8_t* t) __attribute__((target("avx2,fma"))) {
    return _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
  };
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i top_half = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m256i high = table(kStepBytes.high), low = table(kStepBytes.low);
  bytes = _mm256_shuffle_epi8(bytes, table(kPairOrder.source));
  const __m256i nibbles[2] = {_mm256_and_si256(bytes, low_mask),
                              _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask)};  // even, odd
  for (int t = 0; t < 2; ++t) {
    const __m256i lo = _mm256_shuffle_epi8(low, nibbles[t]), hi = _mm256_shuffle_epi8(high, nibbles[t]);
    const __m256i first = _mm256_unpacklo_epi8(lo, hi);   // lane k: bytes q = 0 (low half), 1 (high half)
    const __m256i second = _mm256_unpackhi_epi8(lo, hi);  // lane k: bytes q = 2, 3
    w[0 + t] = _mm256_castsi256_ps(_mm256_slli_epi32(first, 16));
    w[2 + t] = _mm256_castsi256_ps(_mm256_and_si256(first, top_half));
    w[4 + t] = _mm256_castsi256_ps(_mm256_slli_epi32(second, 16));
    w[6 + t] = _mm256_castsi256_ps(_mm256_and_si256(second, top_half));
  }
}

// A row's pair p (p < blocks / 2): its 32 bytes, and its scales [half_scale(block 2p) x 4 | (2p + 1) x 4].
// The odd last block (p = blocks / 2): its 16 bytes then zeros, its scale in all eight lanes.
__attribute__((target("avx2,fma"))) inline __m256i pair_bytes(const uint8_t* row_bytes, int64_t p, bool whole) {
  const uint8_t* bytes = row_bytes + p * kPairBytes;
  if (whole) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
}
__attribute__((target("avx2,fma"))) inline __m256 pair_scale(const uint8_t* row_scale, int64_t p, bool whole) {
  const float first = kHalfScale.value[row_scale[2 * p]];
  const float second = whole ? kHalfScale.value[row_scale[2 * p + 1]] : first;
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(first)), _mm_set1_ps(second), 1);
}

// acc[r] += (sum_j w[j] * step j of xp_r) * s for ROWS rows of x (xp_r = xp + r * stride, each step's values
// COPIES times over): one pair.
template <int ROWS, int COPIES>
__attribute__((target("avx2,fma"))) inline void pair_products(const __m256 w[8], __m256 s, const float* xp,
                                                              int64_t stride, __m256 acc[ROWS]) {
  for (int r = 0; r < ROWS; ++r) {
    const float* xr = xp + r * stride;
    __m256 partial = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
    for (int j = 1; j < 8; ++j) partial = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * COPIES * j), partial);
    acc[r] = _mm256_fmadd_ps(partial, s, acc[r]);
  }
}

// out[r * ldo + n] = sum_k x[r, k] * W[n, k] for r < ROWS and n in [n_begin, n_end), x given in the
// kernels' order (xd, rows `stride` floats apart, COPIES copies): each pair of blocks is decoded once for all
// ROWS rows.
template <int ROWS, int COPIES = 1>
__attribute__((target("avx2,fma"))) void gemv_rows(const float* xd, int64_t stride, const uint8_t* packed,
                                                   const uint8_t* scale, int64_t K, float* out, int64_t ldo,
                                                   int64_t n_begin, int64_t n_end) {
  const int64_t blocks = K / kBlock, whole = blocks / 2;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row_bytes = packed + n * (K / 2);
    const uint8_t* row_scale = scale + n * blocks;
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    __m256 w[8];
    for (int64_t p = 0; p < whole; ++p) {
      if (p % 2 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(row_bytes + p * kPairBytes + kAheadBytes), _MM_HINT_T0);
      }
      decode_pair(pair_bytes(row_bytes, p, true), w);
      pair_products<ROWS, COPIES>(w, pair_scale(row_scale, p, true), xd + COPIES * kPair * p, stride, acc);
    }
    if (blocks % 2 == 1) {
      decode_pair(pair_bytes(row_bytes, whole, false), w);
      pair_products<ROWS, COPIES>(w, pair_scale(row_scale, whole, false), xd + COPIES * kPair * whole, stride,
                                  acc);
    }
    for (int r = 0; r < ROWS; ++r) out[r * ldo + n] = horizontal_sum(acc[r]);
  }
}

using GemvRowsFn = void (*)(const float*, int64_t, const uint8_t*, const uint8_t*, int64_t, float*, int64_t,
                            int64_t, int64_t);
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
