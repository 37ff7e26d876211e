// Vectorised fp32 exp, sigmoid and tanh in 8 lanes (AVX2 + FMA), and the gated activations built on them,
// shared by the KDA, MXFP4 and decode kernels. The
// same code runs on every CPU (no AVX-512 variant), and a caller that sends every value through it (tails
// padded, not computed by libm) gets bits that depend on the value alone: not on the CPU's vector width, the
// batch or the value's position. Accuracy against float64 is tested in tests/ops/test_native_math.py.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace k3_math {

#define K3_MATH __attribute__((target("avx2,fma")))

// exp(x): 2^n exp(r) with n = round(x / ln 2) and r = x - n ln 2 in [-ln2/2, ln2/2], exp(r) by Cephes'
// degree-6 polynomial (relative error ~2e-7, about torch's vectorised exp); 0 below -87.3 (where fp32
// turns subnormal; the kernels never need those), x clamped at 88 (a NaN is taken as -87.3: callers that can
// see one say what they do with it).
K3_MATH inline __m256 exp8(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts: exact n ln2_hi
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

// x where x is NaN, else `value`.
K3_MATH inline __m256 keep_nan(__m256 x, __m256 value) {
  return _mm256_blendv_ps(value, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// 1 / (1 + exp(-x)); exactly 0 below -88 (where exp(-x) leaves fp32: so -inf * sigmoid(-inf) is NaN, as in
// torch), NaN for NaN.
K3_MATH inline __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
  return keep_nan(x, _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-88.0f), _CMP_LT_OQ), s));
}

// x sigmoid(x) (SiLU)
K3_MATH inline __m256 silu8(__m256 x) { return _mm256_mul_ps(x, sigmoid8(x)); }

// tanh(x), Cephes' tanhf: below |x| = 0.625 the odd polynomial x + x^3 P(x^2), above it sign(x) (1 - 2 / (e^2|x|
// + 1)) (exp8 clamped at 88: 1 from |x| = 44 on); NaN for NaN.
K3_MATH inline __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_andnot_ps(sign, x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp8(_mm256_add_ps(a, a));
  const __m256 large = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  const __m256 signed_large = _mm256_or_ps(large, _mm256_and_ps(sign, x));
  const __m256 y = _mm256_blendv_ps(signed_large, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
  return keep_nan(x, y);
}

// a[i] = f(a[i]) for i < n, 8 values at a time; a tail is padded with zeros and goes through f too, so that each
// result depends on its own value alone (not on n or i). f: __m256 -> __m256.
template <typename F>
K3_MATH inline void map8(float* a, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(a + i, f(_mm256_loadu_ps(a + i)));
  if (i == n) return;
  alignas(32) float tail[8] = {};
  std::copy(a + i, a + n, tail);
  _mm256_store_ps(tail, f(_mm256_load_ps(tail)));
  std::copy(tail, tail + (n - i), a + i);
}

// a[i] = f(a[i], b[i]) for i < n, the same way. f: (__m256, __m256) -> __m256.
template <typename F>
K3_MATH inline void map8(float* a, const float* b, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(a + i, f(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  if (i == n) return;
  alignas(32) float tail_a[8] = {}, tail_b[8] = {};
  std::copy(a + i, a + n, tail_a);
  std::copy(b + i, b + n, tail_b);
  _mm256_store_ps(tail_a, f(_mm256_load_ps(tail_a), _mm256_load_ps(tail_b)));
  std::copy(tail_a, tail_a + (n - i), a + i);
}

// The gated activations of k3.model.activations, kind 0 SiLU-GLU silu(g) u, 1 SiTU b tanh(g/b) sigmoid(g)
// c tanh(u/c), 8 values at a time (libm's scalar tanh and exp took ~6 % of a `k3-slice` decode step of 8
// sequences). Every value goes through the vector code (a tail is padded), so each result depends on its g and
// u alone.
struct GatedActivation {
  int64_t kind;
  float beta, linear_beta;

  K3_MATH __m256 operator()(__m256 g, __m256 u) const {
    if (kind == 0) return _mm256_mul_ps(silu8(g), u);
    const __m256 s = sigmoid8(g);
    const __m256 b = _mm256_set1_ps(beta), c = _mm256_set1_ps(linear_beta);
    const __m256 capped_gate = _mm256_mul_ps(b, tanh8(_mm256_div_ps(g, b)));
    const __m256 capped_up = _mm256_mul_ps(c, tanh8(_mm256_div_ps(u, c)));
    return _mm256_mul_ps(_mm256_mul_ps(capped_gate, s), capped_up);
  }

  // g[i] = act(g[i], u[i]) for i < n.
  K3_MATH void apply(float* g, const float* u, int64_t n) const { map8(g, u, n, *this); }

  // The same over bfloat16 g and u (bit patterns): each value widened to fp32 (exact), act computed in fp32
  // and rounded to bfloat16 once (to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN).
  K3_MATH void apply_bf16(uint16_t* g, const uint16_t* u, int64_t n) const {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) narrow_bf16((*this)(widen_bf16(g + i), widen_bf16(u + i)), g + i);
    if (i == n) return;
    alignas(32) uint16_t tail_g[8] = {}, tail_u[8] = {};
    std::copy(g + i, g + n, tail_g);
    std::copy(u + i, u + n, tail_u);
    narrow_bf16((*this)(widen_bf16(tail_g), widen_bf16(tail_u)), tail_g);
    std::copy(tail_g, tail_g + (n - i), g + i);
  }

  K3_MATH static __m256 widen_bf16(const uint16_t* p) {  // 8 bfloat16 values, as fp32
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }

  K3_MATH static void narrow_bf16(__m256 v, uint16_t* p) {  // 8 fp32 values rounded to bfloat16 into p
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    const __m256 quiet_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0));  // torch's bfloat16 NaN
    top = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(top), quiet_nan, nan));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};

#undef K3_MATH

}  // namespace k3_math
