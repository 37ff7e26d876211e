// The decode step of a KDA layer, one token per sequence, in one call (k3/ops/kda/decode.py holds the
// same steps in torch): the three short convs with SiLU, the L2 norms, and the delta-rule update of
// recurrent.py:
//     q, k, v = silu(conv([tail; x]))        per channel, over the last ks inputs
//     q = l2(q) * scale, k = l2(k)           per head
//     kS = (k e^g)^T S,  qS = (q e^g)^T S    one pass over S
//     u  = beta (v - kS),  o = qS + (q . k) u
//     S' = diag(e^g) S + k u^T               a second pass, into a new state
// Layouts (contiguous fp32): x_q, x_k [B, H*K], x_v [B, H*V], tails [B, ks-1, channels], conv weights
// [channels, ks], g [B, H, K], beta [B, H], state [B, H, K, V]. Returns o [B, H, V], the three new tails
// and the new state; the inputs are not modified.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "_native_math.h"

namespace kda_decode {

// y = silu(sum_j full_j * w[:, j]) with full = [tail rows, x], and new_tail = full[1:], for one row b: `channels`
// channels of tail rows `stride` apart (a run of a row's channels: stride = the row's width). The SiLU runs 8
// channels at a time (k3_math::silu8): 512 channels of width 4 took 3.84 us with libm's scalar exp, 2.25 us so
// (one thread, EPYC Zen 3).
inline void short_conv(const float* x, const float* tail, const float* w, int64_t width, int64_t channels,
                       int64_t stride, float* y, float* new_tail) {
  for (int64_t p = 0; p < channels; ++p) {
    const float* wp = w + p * (width + 1);
    float acc = (width > 0 ? tail[p] : x[p]) * wp[0];
    for (int64_t j = 1; j <= width; ++j) acc += (j < width ? tail[j * stride + p] : x[p]) * wp[j];
    y[p] = acc;
  }
  k3_math::map8(y, channels, [](__m256 v) __attribute__((target("avx2,fma"))) { return k3_math::silu8(v); });
  for (int64_t j = 0; j < width; ++j) {
    const float* src = j + 1 < width ? tail + (j + 1) * stride : x;
    std::copy(src, src + channels, new_tail + j * stride);
  }
}

inline float inverse_norm(const float* x, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.0f / std::sqrt(sum + 1e-6f);
}

// One (sequence, head): q, k [K] (normalised), v [V], decay [K] = e^g, S [K, V] -> o [V], S_out [K, V].
// S_out may be S (an update in place): every element of S is read before its own element of S_out is written.
__attribute__((target("avx2,fma"))) inline void delta_step(const float* q, const float* k, const float* v,
                                                           const float* decay, float beta, const float* S,
                                                           int64_t K, int64_t V, float* o, float* S_out,
                                                           float* kS) {
  float qk = 0.0f;
  for (int64_t i = 0; i < K; ++i) qk += q[i] * k[i];
  std::fill(kS, kS + V, 0.0f);
  std::fill(o, o + V, 0.0f);
  for (int64_t i = 0; i < K; ++i) {
    const float a = k[i] * decay[i], b = q[i] * decay[i];
    const float* row = S + i * V;
    for (int64_t j = 0; j < V; ++j) {
      kS[j] += a * row[j];
      o[j] += b * row[j];
    }
  }
  for (int64_t j = 0; j < V; ++j) {
    kS[j] = beta * (v[j] - kS[j]);  // now u
    o[j] += qk * kS[j];
  }
  for (int64_t i = 0; i < K; ++i) {
    const float* row = S + i * V;
    float* out = S_out + i * V;
    for (int64_t j = 0; j < V; ++j) out[j] = row[j] * decay[i] + k[i] * kS[j];
  }
}

inline void check_decode(const torch::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous float32 CPU tensor");
}

inline std::vector<torch::Tensor> decode_step(const torch::Tensor& x_q, const torch::Tensor& x_k,
                                              const torch::Tensor& x_v, const torch::Tensor& tail_q,
                                              const torch::Tensor& tail_k, const torch::Tensor& tail_v,
                                              const torch::Tensor& w_q, const torch::Tensor& w_k,
                                              const torch::Tensor& w_v, const torch::Tensor& g,
                                              const torch::Tensor& beta, const torch::Tensor& state,
                                              double scale) {
  for (auto* t : {&x_q, &x_k, &x_v, &w_q, &w_k, &w_v, &beta}) check_decode(*t, 2, "x, conv weight, beta");
  for (auto* t : {&tail_q, &tail_k, &tail_v, &g}) check_decode(*t, 3, "tails and g");
  check_decode(state, 4, "state");
  const int64_t B = state.size(0), H = state.size(1), K = state.size(2), V = state.size(3);
  const int64_t width = tail_q.size(1);
  TORCH_CHECK(x_q.sizes() == torch::IntArrayRef({B, H * K}) && x_k.sizes() == x_q.sizes() &&
                  x_v.sizes() == torch::IntArrayRef({B, H * V}),
              "x_q, x_k must be [B, H*K] and x_v [B, H*V] for the state's [B, H, K, V]");
  TORCH_CHECK(g.sizes() == torch::IntArrayRef({B, H, K}) && beta.sizes() == torch::IntArrayRef({B, H}),
              "g must be [B, H, K] and beta [B, H]");
  TORCH_CHECK(tail_q.sizes() == torch::IntArrayRef({B, width, H * K}) && tail_k.sizes() == tail_q.sizes() &&
                  tail_v.sizes() == torch::IntArrayRef({B, width, H * V}),
              "tails must be [B, ks-1, channels]");
  TORCH_CHECK(w_q.sizes() == torch::IntArrayRef({H * K, width + 1}) && w_k.sizes() == w_q.sizes() &&
                  w_v.sizes() == torch::IntArrayRef({H * V, width + 1}),
              "conv weights must be [channels, ks]");
  auto y_q = torch::empty_like(x_q), y_k = torch::empty_like(x_k), y_v = torch::empty_like(x_v);
  auto new_q = torch::empty_like(tail_q), new_k = torch::empty_like(tail_k), new_v = torch::empty_like(tail_v);
  auto o = torch::empty({B, H, V}, state.options());
  auto new_state = torch::empty_like(state);
  for (int64_t b = 0; b < B; ++b) {
    short_conv(x_q.data_ptr<float>() + b * H * K, tail_q.data_ptr<float>() + b * width * H * K,
               w_q.data_ptr<float>(), width, H * K, H * K, y_q.data_ptr<float>() + b * H * K,
               new_q.data_ptr<float>() + b * width * H * K);
    short_conv(x_k.data_ptr<float>() + b * H * K, tail_k.data_ptr<float>() + b * width * H * K,
               w_k.data_ptr<float>(), width, H * K, H * K, y_k.data_ptr<float>() + b * H * K,
               new_k.data_ptr<float>() + b * width * H * K);
    short_conv(x_v.data_ptr<float>() + b * H * V, tail_v.data_ptr<float>() + b * width * H * V,
               w_v.data_ptr<float>(), width, H * V, H * V, y_v.data_ptr<float>() + b * H * V,
               new_v.data_ptr<float>() + b * width * H * V);
  }
  // about K*V*4 flops per head: split across threads only when there are many heads
  at::parallel_for(0, B * H, 16, [&](int64_t z0, int64_t z1) {
    std::vector<float> q(K), k(K), decay(K), kS(V);
    for (int64_t z = z0; z < z1; ++z) {
      const float* yq = y_q.data_ptr<float>() + z * K;
      const float* yk = y_k.data_ptr<float>() + z * K;
      const float nq = inverse_norm(yq, K), nk = inverse_norm(yk, K);
      const float* gz = g.data_ptr<float>() + z * K;
      for (int64_t i = 0; i < K; ++i) {
        q[i] = yq[i] * nq * static_cast<float>(scale);
        k[i] = yk[i] * nk;
        decay[i] = std::exp(gz[i]);
      }
      delta_step(q.data(), k.data(), y_v.data_ptr<float>() + z * V, decay.data(), beta.data_ptr<float>()[z],
                 state.data_ptr<float>() + z * K * V, K, V, o.data_ptr<float>() + z * V,
                 new_state.data_ptr<float>() + z * K * V, kS.data());
    }
  });
  return {o, new_q, new_k, new_v, new_state};
}

}  // namespace kda_decode
