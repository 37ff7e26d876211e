// Native CPU kernels for chunked KDA (k3/ops/kda/chunk.py holds the math and the same steps in torch;
// this file only runs them faster). Two entry points:
//
// 1. The inter-chunk state recurrence and its adjoint, for training (state_passing.py's StatePassing).
//    Per chunk i of every sequence-head z, from the state S [K, V] at the chunk's start:
//        reads_i = (q Gamma)_i S                 [C, V]
//        u_i     = U_i - W_i S                   [C, V]
//        S      <- diag(gamma_i) S + K_hat_i^T u_i
//    and backward, from dS = d final state:
//        du_i = d_u_i + K_hat_i dS               (total gradient of u_i)
//        dS  <- diag(gamma_i) dS + (q Gamma)_i^T d_reads_i - W_i^T du_i
//
// 2. `forward`: the whole chunked forward without gradients (prefill), from the token layout to the
//    token layout. Each thread takes whole sequence-heads; per chunk it builds the chunk's terms
//    (base_terms in chunk.py: L2 norms, decays, the triangular solve, W, U, K_hat) in scratch memory,
//    then runs the step above and o = reads + P u. Nothing but the inputs and outputs touches memory.
//
// Why native: per chunk these are [16 x 128] x [128 x 128] products, too small for torch's batched
// matmul to run near GEMM speed (~65 of ~190 GFLOP/s here), and torch pays a few microseconds of
// dispatch per op and a pass over memory per elementwise step. Here the state stays in its core's
// cache and every product is one register-blocked AVX2/FMA kernel that also applies the decay and
// the accumulation.
//
// Layouts (contiguous fp32): q_gamma, w, k_hat [steps, Z, C, K]; u_in, reads, u, d_* [steps, Z, C, V];
// decay [steps, Z, K]; states [Z, K, V]; `forward` takes fla's token layout q, k, g [rows, H, K],
// v [rows, H, V], beta [rows, H]. AVX2 + FMA per function (__attribute__((target))), so the module
// loads on any x86-64 CPU; `cpu_supported()` tells Python whether the kernels may be called.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

// The build passes -DK3_NATIVE_SOURCE_HASH=<hex digest of this file>, so Python can detect a stale build.
#ifndef K3_NATIVE_SOURCE_HASH
#define K3_NATIVE_SOURCE_HASH unknown
#endif
#define K3_STRINGIFY_VALUE(x) K3_STRINGIFY(x)
#define K3_STRINGIFY(x) #x

namespace {

constexpr int kRows = 6;  // rows of the output per register block: 6 x 16 floats = 12 accumulators

// A matrix operand read element by element: (m, k) at data[m * row_stride + k * col_stride], so that
// A and A^T of a row-major matrix are both plain operands.
struct Operand {
  const float* data;
  int64_t row_stride;
  int64_t col_stride;
};

// One product, out[M, N] = diag(scale) base + sign * A[M, Kd] B[Kd, N], with B and out row-major
// (leading dimension N), base [M, N] (may be out itself, or nullptr for zero) and scale [M] (nullptr
// for ones).
struct Product {
  int64_t M, N, Kd;
  Operand a;
  const float* b;
  float sign;
  const float* base;
  const float* scale;
  float* out;
};

// Rows [m0, m0 + R) x columns [n0, n0 + 8 * W) of a Product, accumulated in registers over all of Kd.
// The sign is applied once at the end: acc = sign * scale * base, acc += A B, out = sign * acc.
template <int R, int W>
__attribute__((target("avx2,fma"))) inline void register_block(const Product& p, int64_t m0, int64_t n0) {
  const int64_t N = p.N, Kd = p.Kd, a_rows = p.a.row_stride, a_cols = p.a.col_stride;
  const __m256 sign = _mm256_set1_ps(p.sign);
  __m256 acc[R][W];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const float* base = p.base + (m0 + r) * N + n0;
    const __m256 s = _mm256_mul_ps(sign, _mm256_set1_ps(p.scale ? p.scale[m0 + r] : 1.0f));
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) {
      acc[r][w] = p.base ? _mm256_mul_ps(s, _mm256_loadu_ps(base + 8 * w)) : _mm256_setzero_ps();
    }
  }
  const float* a = p.a.data + m0 * a_rows;
  const float* b = p.b + n0;
  for (int64_t k = 0; k < Kd; ++k) {
    __m256 b_k[W];
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) b_k[w] = _mm256_loadu_ps(b + k * N + 8 * w);
    const float* a_k = a + k * a_cols;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a_k + r * a_rows);
#pragma GCC unroll 2
      for (int w = 0; w < W; ++w) acc[r][w] = _mm256_fmadd_ps(x, b_k[w], acc[r][w]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(p.out + (m0 + r) * N + n0 + 8 * w, _mm256_mul_ps(sign, acc[r][w]));
  }
}

// The rows [m0, M) in blocks of kRows, the last block shorter.
template <int W>
__attribute__((target("avx2,fma"))) void column_panel(const Product& p, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + kRows <= p.M; m0 += kRows) register_block<kRows, W>(p, m0, n0);
  switch (p.M - m0) {
    case 5: register_block<5, W>(p, m0, n0); break;
    case 4: register_block<4, W>(p, m0, n0); break;
    case 3: register_block<3, W>(p, m0, n0); break;
    case 2: register_block<2, W>(p, m0, n0); break;
    case 1: register_block<1, W>(p, m0, n0); break;
    default: break;
  }
}

// Column panels of 16 (a B panel of Kd x 16 floats stays in L1 across the row blocks), then 8, then
// single columns for N not a multiple of 8.
__attribute__((target("avx2,fma"))) void run(const Product& p) {
  int64_t n0 = 0;
  for (; n0 + 16 <= p.N; n0 += 16) column_panel<2>(p, n0);
  for (; n0 + 8 <= p.N; n0 += 8) column_panel<1>(p, n0);
  for (; n0 < p.N; ++n0) {
    for (int64_t m = 0; m < p.M; ++m) {
      float acc = p.base ? (p.scale ? p.scale[m] : 1.0f) * p.base[m * p.N + n0] : 0.0f;
      for (int64_t k = 0; k < p.Kd; ++k) {
        acc += p.sign * p.a.data[m * p.a.row_stride + k * p.a.col_stride] * p.b[k * p.N + n0];
      }
      p.out[m * p.N + n0] = acc;
    }
  }
}

Operand plain(const float* data, int64_t cols) { return {data, cols, 1}; }
Operand transposed(const float* data, int64_t cols) { return {data, 1, cols}; }

void check(const torch::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous fp32 CPU tensor");
}

struct Shape {
  int64_t steps, Z, C, K, V;
};

Shape check_shapes(const torch::Tensor& q_gamma, const torch::Tensor& w, const torch::Tensor& k_hat,
                   const torch::Tensor& decay, const torch::Tensor& by_value, const torch::Tensor& state) {
  check(q_gamma, 4, "q_gamma");
  check(w, 4, "w");
  check(k_hat, 4, "k_hat");
  check(decay, 3, "decay");
  check(by_value, 4, "a [steps, Z, C, V] input");
  check(state, 3, "state");
  const Shape s{q_gamma.size(0), q_gamma.size(1), q_gamma.size(2), q_gamma.size(3), state.size(2)};
  TORCH_CHECK(w.sizes() == q_gamma.sizes() && k_hat.sizes() == q_gamma.sizes(),
              "q_gamma, w and k_hat must have the same shape [steps, Z, C, K]");
  TORCH_CHECK(decay.sizes() == torch::IntArrayRef({s.steps, s.Z, s.K}), "decay must be [steps, Z, K]");
  TORCH_CHECK(by_value.sizes() == torch::IntArrayRef({s.steps, s.Z, s.C, s.V}), "inputs by value must be "
              "[steps, Z, C, V]");
  TORCH_CHECK(state.size(0) == s.Z && state.size(1) == s.K, "state must be [Z, K, V]");
  return s;
}

// reads, u, final state: the forward recurrence over all chunks, parallel over z.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> state_forward(
    const torch::Tensor& q_gamma, const torch::Tensor& w, const torch::Tensor& u_in,
    const torch::Tensor& k_hat, const torch::Tensor& decay, const torch::Tensor& state) {
  const Shape s = check_shapes(q_gamma, w, k_hat, decay, u_in, state);
  auto reads = torch::empty_like(u_in);
  auto u = torch::empty_like(u_in);
  auto final_state = state.clone();
  const int64_t kv = s.K * s.V, ck = s.C * s.K, cv = s.C * s.V;
  at::parallel_for(0, s.Z, 1, [&](int64_t z0, int64_t z1) {
    for (int64_t z = z0; z < z1; ++z) {
      float* S = final_state.data_ptr<float>() + z * kv;
      for (int64_t i = 0; i < s.steps; ++i) {
        const int64_t at = i * s.Z + z;
        float* u_i = u.data_ptr<float>() + at * cv;
        run({s.C, s.V, s.K, plain(q_gamma.data_ptr<float>() + at * ck, s.K), S, 1.0f, nullptr, nullptr,
             reads.data_ptr<float>() + at * cv});
        run({s.C, s.V, s.K, plain(w.data_ptr<float>() + at * ck, s.K), S, -1.0f,
             u_in.data_ptr<float>() + at * cv, nullptr, u_i});
        run({s.K, s.V, s.C, transposed(k_hat.data_ptr<float>() + at * ck, s.K), u_i, 1.0f, S,
             decay.data_ptr<float>() + at * s.K, S});
      }
    }
  });
  return {reads, u, final_state};
}

// [steps + 1, Z, K, V]: every chunk's starting state and the final one, from the first state and u.
torch::Tensor state_history(const torch::Tensor& k_hat, const torch::Tensor& u, const torch::Tensor& decay,
                            const torch::Tensor& state) {
  const Shape s = check_shapes(k_hat, k_hat, k_hat, decay, u, state);
  auto states = torch::empty({s.steps + 1, s.Z, s.K, s.V}, state.options());
  states[0].copy_(state);
  const int64_t kv = s.K * s.V, ck = s.C * s.K, cv = s.C * s.V;
  at::parallel_for(0, s.Z, 1, [&](int64_t z0, int64_t z1) {
    for (int64_t z = z0; z < z1; ++z) {
      for (int64_t i = 0; i < s.steps; ++i) {
        const int64_t at = i * s.Z + z;
        float* before = states.data_ptr<float>() + at * kv;
        run({s.K, s.V, s.C, transposed(k_hat.data_ptr<float>() + at * ck, s.K), u.data_ptr<float>() + at * cv,
             1.0f, before, decay.data_ptr<float>() + at * s.K, before + s.Z * kv});
      }
    }
  });
  return states;
}

// du (total gradient of u) and dS_i for i = 0..steps: the adjoint recurrence, parallel over z.
std::tuple<torch::Tensor, torch::Tensor> state_backward(
    const torch::Tensor& q_gamma, const torch::Tensor& w, const torch::Tensor& k_hat,
    const torch::Tensor& decay, const torch::Tensor& d_reads, const torch::Tensor& d_u,
    const torch::Tensor& d_final) {
  const Shape s = check_shapes(q_gamma, w, k_hat, decay, d_reads, d_final);
  TORCH_CHECK(d_u.sizes() == d_reads.sizes(), "d_u must be [steps, Z, C, V]");
  check(d_u, 4, "d_u");
  auto du = torch::empty_like(d_u);
  auto d_states = torch::empty({s.steps + 1, s.Z, s.K, s.V}, d_final.options());
  d_states[s.steps].copy_(d_final);
  const int64_t kv = s.K * s.V, ck = s.C * s.K, cv = s.C * s.V;
  at::parallel_for(0, s.Z, 1, [&](int64_t z0, int64_t z1) {
    for (int64_t z = z0; z < z1; ++z) {
      for (int64_t i = s.steps - 1; i >= 0; --i) {
        const int64_t at = i * s.Z + z;
        const float* d_next = d_states.data_ptr<float>() + (at + s.Z) * kv;
        float* d_now = d_states.data_ptr<float>() + at * kv;
        float* du_i = du.data_ptr<float>() + at * cv;
        run({s.C, s.V, s.K, plain(k_hat.data_ptr<float>() + at * ck, s.K), d_next, 1.0f,
             d_u.data_ptr<float>() + at * cv, nullptr, du_i});
        run({s.K, s.V, s.C, transposed(q_gamma.data_ptr<float>() + at * ck, s.K),
             d_reads.data_ptr<float>() + at * cv, 1.0f, d_next, decay.data_ptr<float>() + at * s.K, d_now});
        run({s.K, s.V, s.C, transposed(w.data_ptr<float>() + at * ck, s.K), du_i, -1.0f, d_now, nullptr,
             d_now});
      }
    }
  });
  return {du, d_states};
}

// ---------------------------------------------------------------- the fused forward (no gradients)

// exp(x) for x in [-87, 88]: 2^n exp(r) with n = round(x / ln 2) and r = x - n ln 2 in [-ln2/2, ln2/2],
// exp(r) by Cephes' degree-6 polynomial (relative error ~2e-7, about torch's vectorised exp).
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
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
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// out[j] = exp(x[j]) for j < n
__attribute__((target("avx2,fma"))) void exp_into(const float* x, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, exp8(_mm256_loadu_ps(x + j)));
  for (; j < n; ++j) out[j] = std::exp(x[j]);
}

struct ForwardOptions {
  int64_t C;          // chunk size: one base chunk, (C - 1) |min g| <= 80 (checked by the caller)
  float scale;        // q's scale
  bool l2norm;        // L2-normalise q and k first
  float eps;          // inside the L2 norm's square root
};

// One thread's working memory for one chunk, reused from chunk to chunk (a few tens of kB).
struct ChunkScratch {
  int64_t C, K, V;
  std::vector<float> q, k, v, beta;  // the chunk's inputs, q and k normalised and scaled
  std::vector<float> G, local, down;  // cumulative log-decay, relative to the first token, exp(local)
  std::vector<float> left;            // [q; k] * exp(local) [2C, K]; the q rows become q Gamma
  std::vector<float> k_over, k_over_t, k_gamma, k_hat;  // k * exp(-local), its transpose, k Gamma, K_hat
  std::vector<float> scores, t_beta;  // [P; A] [2C, C], (I + A)^-1 diag(beta) [C, C]
  std::vector<float> w, u_in, reads, u, o, decay;
  ChunkScratch(int64_t C_, int64_t K_, int64_t V_)
      : C(C_), K(K_), V(V_), q(C * K), k(C * K), v(C * V), beta(C), G(C * K), local(C * K), down(C * K),
        left(2 * C * K), k_over(C * K), k_over_t(K * C), k_gamma(C * K), k_hat(C * K), scores(2 * C * C),
        t_beta(C * C), w(C * K), u_in(C * V), reads(C * V), u(C * V), o(C * V), decay(K) {}
};

// The terms of one chunk (chunk.py's base_terms for s = C), from its `rows` valid tokens (the rest
// are padding: zeros, which neither decay nor write).
__attribute__((target("avx2,fma"))) void chunk_terms(ChunkScratch& t, const ForwardOptions& opt) {
  const int64_t C = t.C, K = t.K, V = t.V;
  for (int64_t c = 0; c < C; ++c) {  // L2 norm (fla's x / sqrt(sum x^2 + eps)) and q's scale
    float* qc = t.q.data() + c * K;
    float* kc = t.k.data() + c * K;
    float fq = opt.scale, fk = 1.0f;
    if (opt.l2norm) {
      float sq = 0.0f, sk = 0.0f;
      for (int64_t j = 0; j < K; ++j) sq += qc[j] * qc[j], sk += kc[j] * kc[j];
      fq = opt.scale / std::sqrt(sq + opt.eps);
      fk = 1.0f / std::sqrt(sk + opt.eps);
    }
    for (int64_t j = 0; j < K; ++j) qc[j] *= fq, kc[j] *= fk;
  }
  for (int64_t c = 1; c < C; ++c) {  // G: in-chunk cumulative sum (t.G holds g on entry)
    for (int64_t j = 0; j < K; ++j) t.G[c * K + j] += t.G[(c - 1) * K + j];
  }
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t j = 0; j < K; ++j) t.local[c * K + j] = t.G[c * K + j] - t.G[j];
  }
  exp_into(t.local.data(), t.down.data(), C * K);  // in [e^-80, 1]
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t at = c * K + j;
      t.left[at] = t.q[at] * t.down[at];
      t.left[C * K + at] = t.k[at] * t.down[at];
      t.k_over[at] = t.k[at] / t.down[at];
      t.k_over_t[j * C + c] = t.k_over[at];
    }
  }
  run({2 * C, C, K, plain(t.left.data(), K), t.k_over_t.data(), 1.0f, nullptr, nullptr, t.scores.data()});
  // P keeps its lower triangle with the diagonal; A = beta_i * (strict lower triangle), then
  // (I + A)^-1 by forward substitution, its columns times beta_j
  float* P = t.scores.data();
  float* A = t.scores.data() + C * C;
  std::fill(t.t_beta.begin(), t.t_beta.end(), 0.0f);
  for (int64_t i = 0; i < C; ++i) {
    for (int64_t j = i + 1; j < C; ++j) P[i * C + j] = 0.0f;
    for (int64_t j = 0; j < i; ++j) A[i * C + j] *= t.beta[i];
    float* Ti = t.t_beta.data() + i * C;
    Ti[i] = 1.0f;
    for (int64_t m = 0; m < i; ++m) {  // row i of T = -sum_m A[i, m] T[m, :] (T[m, :] ends at m)
      const float a = A[i * C + m];
      const float* Tm = t.t_beta.data() + m * C;
      for (int64_t j = 0; j <= m; ++j) Ti[j] -= a * Tm[j];
    }
  }
  for (int64_t i = 0; i < C; ++i) {
    for (int64_t j = 0; j <= i; ++j) t.t_beta[i * C + j] *= t.beta[j];
  }
  // exp(g_0) turns the decays relative to the first token into Gamma: q Gamma (in place) and k Gamma
  exp_into(t.G.data(), t.decay.data(), K);
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t j = 0; j < K; ++j) {
      t.left[c * K + j] *= t.decay[j];
      t.k_gamma[c * K + j] = t.left[C * K + c * K + j] * t.decay[j];
    }
  }
  run({C, K, C, plain(t.t_beta.data(), C), t.k_gamma.data(), 1.0f, nullptr, nullptr, t.w.data()});
  run({C, V, C, plain(t.t_beta.data(), C), t.v.data(), 1.0f, nullptr, nullptr, t.u_in.data()});
  // K_hat = k exp(-local) exp(local_last); Gamma_C = exp(G_last)
  exp_into(t.local.data() + (C - 1) * K, t.down.data(), K);
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t j = 0; j < K; ++j) t.k_hat[c * K + j] = t.k_over[c * K + j] * t.down[j];
  }
  exp_into(t.G.data() + (C - 1) * K, t.decay.data(), K);
}

// o [rows, H, V] and final states [N, H, K, V] from fla's token layout; sequence n is rows
// [starts[n], starts[n] + lengths[n]). Parallel over (sequence, head).
std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& v, const torch::Tensor& g,
                                                 const torch::Tensor& beta, const torch::Tensor& starts,
                                                 const torch::Tensor& lengths, const torch::Tensor& initial_state,
                                                 int64_t chunk_size, double scale, bool l2norm, double eps) {
  check(q, 3, "q");
  check(k, 3, "k");
  check(v, 3, "v");
  check(g, 3, "g");
  check(beta, 2, "beta");
  check(initial_state, 4, "initial_state");
  const int64_t rows = q.size(0), H = q.size(1), K = q.size(2), V = v.size(2), N = starts.numel();
  TORCH_CHECK(k.sizes() == q.sizes() && g.sizes() == q.sizes(), "k and g must have q's shape [rows, H, K]");
  TORCH_CHECK(v.size(0) == rows && v.size(1) == H && beta.size(0) == rows && beta.size(1) == H,
              "v must be [rows, H, V] and beta [rows, H]");
  TORCH_CHECK(initial_state.sizes() == torch::IntArrayRef({N, H, K, V}), "initial_state must be [N, H, K, V]");
  TORCH_CHECK(chunk_size >= 1 && chunk_size <= 64, "chunk_size must be in [1, 64]");
  TORCH_CHECK(starts.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64 &&
                  lengths.numel() == N,
              "starts and lengths must be int64 [N]");
  const int64_t* start_of = starts.data_ptr<int64_t>();
  const int64_t* length_of = lengths.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(start_of[n] >= 0 && length_of[n] >= 0 && start_of[n] + length_of[n] <= rows,
                "sequence ", n, " lies outside the rows");
  }
  auto o = torch::zeros({rows, H, V}, q.options());
  auto final_state = initial_state.clone();
  const ForwardOptions opt{chunk_size, static_cast<float>(scale), l2norm, static_cast<float>(eps)};
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = o.data_ptr<float>();
  at::parallel_for(0, N * H, 1, [&](int64_t z0, int64_t z1) {
    const int64_t C = opt.C;
    ChunkScratch t(C, K, V);
    for (int64_t z = z0; z < z1; ++z) {
      const int64_t n = z / H, h = z % H, length = length_of[n];
      float* S = final_state.data_ptr<float>() + z * K * V;
      for (int64_t c0 = 0; c0 < length; c0 += C) {
        const int64_t valid = std::min(C, length - c0);
        for (int64_t c = 0; c < C; ++c) {  // gather the chunk's rows (zeros past the end)
          const int64_t row = (start_of[n] + c0 + c) * H + h;
          const bool inside = c < valid;
          for (int64_t j = 0; j < K; ++j) {
            t.q[c * K + j] = inside ? qp[row * K + j] : 0.0f;
            t.k[c * K + j] = inside ? kp[row * K + j] : 0.0f;
            t.G[c * K + j] = inside ? gp[row * K + j] : 0.0f;
          }
          for (int64_t j = 0; j < V; ++j) t.v[c * V + j] = inside ? vp[row * V + j] : 0.0f;
          t.beta[c] = inside ? bp[row] : 0.0f;
        }
        chunk_terms(t, opt);
        run({C, V, K, plain(t.left.data(), K), S, 1.0f, nullptr, nullptr, t.reads.data()});
        run({C, V, K, plain(t.w.data(), K), S, -1.0f, t.u_in.data(), nullptr, t.u.data()});
        run({K, V, C, transposed(t.k_hat.data(), K), t.u.data(), 1.0f, S, t.decay.data(), S});
        run({C, V, C, plain(t.scores.data(), C), t.u.data(), 1.0f, t.reads.data(), nullptr, t.o.data()});
        for (int64_t c = 0; c < valid; ++c) {
          std::copy_n(t.o.data() + c * V, V, op + ((start_of[n] + c0 + c) * H + h) * V);
        }
      }
    }
  });
  return {o, final_state};
}

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "k3 KDA native CPU kernels (AVX2 + FMA): the inter-chunk state recurrence and its adjoint";
  m.def("state_forward", &state_forward, "(reads, u, final state) of the chunk recurrence",
        py::arg("q_gamma"), py::arg("w"), py::arg("u_in"), py::arg("k_hat"), py::arg("decay"),
        py::arg("state"));
  m.def("state_history", &state_history, "[steps + 1, Z, K, V] states from the first state and u",
        py::arg("k_hat"), py::arg("u"), py::arg("decay"), py::arg("state"));
  m.def("state_backward", &state_backward, "(du, d states) of the adjoint recurrence", py::arg("q_gamma"),
        py::arg("w"), py::arg("k_hat"), py::arg("decay"), py::arg("d_reads"), py::arg("d_u"),
        py::arg("d_final"));
  m.def("forward", &forward, "(o, final states): the chunked forward from the token layout, no gradients",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("starts"),
        py::arg("lengths"), py::arg("initial_state"), py::arg("chunk_size"), py::arg("scale"), py::arg("l2norm"),
        py::arg("eps"));
  m.def("cpu_supported", &cpu_supported, "whether this CPU has AVX2 and FMA");
  m.attr("source_hash") = K3_STRINGIFY_VALUE(K3_NATIVE_SOURCE_HASH);
}
