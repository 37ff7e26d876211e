// Native CPU kernels for chunked KDA (k3/ops/kda/chunk.py holds the math and the same steps in torch;
// this file only runs them faster). Two entry points:
//
// 1. The inter-chunk state recurrence and its adjoint (state_passing.py's StatePassing, which chunk.py
//    uses where it builds chunks by merges).
//    Per chunk i of every sequence-head z, from the state S [K, V] at the chunk's start:
//        reads_i = (q Gamma)_i S                 [C, V]
//        u_i     = U_i - W_i S                   [C, V]
//        S      <- diag(gamma_i) S + K_hat_i^T u_i
//    and backward, from dS = d final state:
//        du_i = d_u_i + K_hat_i dS               (total gradient of u_i)
//        dS  <- diag(gamma_i) dS + (q Gamma)_i^T d_reads_i - W_i^T du_i
//
// 2. `forward` and `backward`: the whole chunked form when one base chunk is the chunk (fused.py), from
//    the token layout to the token layout. Each thread takes whole sequence-heads; per chunk it builds
//    the chunk's terms (base_terms in chunk.py: L2 norms, decays, the triangular inverse, W, U, K_hat)
//    in scratch memory, then runs the step above and o = reads + P u. The backward recomputes the
//    chunk-start states, then walks the chunks backwards through the adjoint of every step.
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

#include "_native_products.h"

// The build passes -DK3_NATIVE_SOURCE_HASH=<hex digest of this file>, so Python can detect a stale build.
#ifndef K3_NATIVE_SOURCE_HASH
#define K3_NATIVE_SOURCE_HASH unknown
#endif
#define K3_STRINGIFY_VALUE(x) K3_STRINGIFY(x)
#define K3_STRINGIFY(x) #x

namespace {

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

// Every gradient of the recurrence: the adjoint loop, parallel over z, and per chunk the products
// with S_i and dS_{i+1} while both are in cache:
//     d(q Gamma)_i = dR_i S_i^T,  dW_i = -du_i S_i^T,  dK_hat_i = u_i dS_{i+1}^T,
//     dgamma_i = sum_V S_i * dS_{i+1},  dU_i = du_i,  d initial state = dS_0.
// `states` [steps + 1, Z, K, V] are the chunks' starting states (state_history).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>
state_backward(const torch::Tensor& q_gamma, const torch::Tensor& w, const torch::Tensor& k_hat,
               const torch::Tensor& decay, const torch::Tensor& u, const torch::Tensor& states,
               const torch::Tensor& d_reads, const torch::Tensor& d_u, const torch::Tensor& d_final) {
  const Shape s = check_shapes(q_gamma, w, k_hat, decay, d_reads, d_final);
  for (const auto* t : {&u, &d_u}) {
    check(*t, 4, "u and d_u");
    TORCH_CHECK(t->sizes() == d_reads.sizes(), "u and d_u must be [steps, Z, C, V]");
  }
  check(states, 4, "states");
  TORCH_CHECK(states.sizes() == torch::IntArrayRef({s.steps + 1, s.Z, s.K, s.V}), "states must be "
              "[steps + 1, Z, K, V]");
  auto d_q_gamma = torch::empty_like(q_gamma);
  auto d_w = torch::empty_like(w);
  auto du = torch::empty_like(d_u);
  auto d_k_hat = torch::empty_like(k_hat);
  auto d_decay = torch::empty_like(decay);
  auto d_state = d_final.clone();  // dS, carried back chunk by chunk
  const int64_t kv = s.K * s.V, ck = s.C * s.K, cv = s.C * s.V;
  at::parallel_for(0, s.Z, 1, [&](int64_t z0, int64_t z1) {
    std::vector<float> state_t(kv);  // [V, K]: dS^T, then S^T
    for (int64_t z = z0; z < z1; ++z) {
      float* dS = d_state.data_ptr<float>() + z * kv;  // dS_{i+1} on entry to step i, dS_i after it
      for (int64_t i = s.steps - 1; i >= 0; --i) {
        const int64_t at = i * s.Z + z;
        const float* S = states.data_ptr<float>() + at * kv;
        const float* gamma = decay.data_ptr<float>() + at * s.K;
        const float* dR = d_reads.data_ptr<float>() + at * cv;
        float* du_i = du.data_ptr<float>() + at * cv;
        run({s.C, s.V, s.K, plain(k_hat.data_ptr<float>() + at * ck, s.K), dS, 1.0f,
             d_u.data_ptr<float>() + at * cv, nullptr, du_i});
        transpose_into(dS, s.K, s.V, state_t.data());  // products with dS^T and S^T as plain ones
        run({s.C, s.K, s.V, plain(u.data_ptr<float>() + at * cv, s.V), state_t.data(), 1.0f, nullptr, nullptr,
             d_k_hat.data_ptr<float>() + at * ck});
        row_dots(S, dS, s.K, s.V, d_decay.data_ptr<float>() + at * s.K);
        transpose_into(S, s.K, s.V, state_t.data());
        run({s.C, s.K, s.V, plain(dR, s.V), state_t.data(), 1.0f, nullptr, nullptr,
             d_q_gamma.data_ptr<float>() + at * ck});
        run({s.C, s.K, s.V, plain(du_i, s.V), state_t.data(), -1.0f, nullptr, nullptr,
             d_w.data_ptr<float>() + at * ck});
        run({s.K, s.V, s.C, transposed(q_gamma.data_ptr<float>() + at * ck, s.K), dR, 1.0f, dS, gamma, dS});
        run({s.K, s.V, s.C, transposed(w.data_ptr<float>() + at * ck, s.K), du_i, -1.0f, dS, nullptr, dS});
      }
    }
  });
  return {d_q_gamma, d_w, du, d_k_hat, d_decay, d_state};
}

// ---------------------------------------------------------------- the fused chunked form, token layout in and out

struct ChunkOptions {
  int64_t C;    // chunk size: one base chunk, (C - 1) |min g| <= 80 (checked by the caller)
  float scale;  // q's scale
  bool l2norm;  // L2-normalise q and k first
  float eps;    // inside the L2 norm's square root
};

// Where the sequences lie in the token layout: sequence n is rows [start[n], start[n] + length[n]), one
// after the other, covering every row.
struct Sequences {
  const int64_t* start;
  const int64_t* length;
};

// Asks for the cache lines of x[0, n) ahead of use.
inline void prefetch(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) __builtin_prefetch(x + j);
}

// One chunk's inputs and terms (chunk.py's base_terms for s = C), in one thread's scratch memory,
// reused from chunk to chunk. [C, K] unless noted.
struct ChunkTerms {
  int64_t C, K, V;
  std::vector<float> q, k, v, beta;   // inputs; q and k normalised and scaled in place; v [C, V], beta [C]
  std::vector<float> q_factor, k_factor;  // [C]: what the rows of q and k were multiplied by
  std::vector<float> G, local, down;  // in-chunk cumulative log-decay, G - G_0, exp(G - G_0)
  std::vector<float> left, k_over, k_over_t;  // [2C, K]: q, then k, times down; k / down; its [K, C] transpose
  std::vector<float> scores;          // [2C, C]: P (lower triangle with the diagonal), then left_k k_over^T
  std::vector<float> t_inv, t_beta;   // [C, C]: T = (I + A)^-1 with A = diag(beta) strict_lower(...); T diag(beta)
  std::vector<float> first, last, decay;  // [K]: exp(G_0), exp(G_last - G_0), Gamma_C = exp(G_last)
  std::vector<float> reading;          // [2C, K]: q Gamma, then W (what reads the state, in one product)
  std::vector<float> k_gamma, k_hat, u_in;  // u_in = U [C, V]
  float* q_gamma() { return reading.data(); }
  float* w() { return reading.data() + C * K; }
  ChunkTerms(int64_t C_, int64_t K_, int64_t V_)
      : C(C_), K(K_), V(V_), q(C * K), k(C * K), v(C * V), beta(C), q_factor(C), k_factor(C), G(C * K),
        local(C * K), down(C * K), left(2 * C * K), k_over(C * K), k_over_t(K * C),
        scores(2 * C * C), t_inv(C * C), t_beta(C * C), first(K), last(K), decay(K), reading(2 * C * K),
        k_gamma(C * K), k_hat(C * K), u_in(C * V) {}

  float* left_q() { return left.data(); }
  float* left_k() { return left.data() + C * K; }
  float* P() { return scores.data(); }
  float* Sk() { return scores.data() + C * C; }

  // Copies the `valid` rows from `first_row` on of head h (zeros after them: padding neither decays nor
  // writes) and builds the terms. The `next_valid` rows from `next_first_row` on (the chunk to be loaded
  // next) are prefetched meanwhile: a head's rows lie H * K floats apart, one page each in K3's shapes,
  // which the hardware prefetchers do not follow.
  void load(const float* q_in, const float* k_in, const float* v_in, const float* g_in, const float* beta_in,
            int64_t H, int64_t first_row, int64_t valid, int64_t h, const ChunkOptions& opt,
            int64_t next_first_row, int64_t next_valid) {
    for (int64_t c = 0; c < next_valid; ++c) {
      const int64_t row = (next_first_row + c) * H + h;
      for (const float* p : {q_in + row * K, k_in + row * K, g_in + row * K}) prefetch(p, K);
      prefetch(v_in + row * V, V);
    }
    for (int64_t c = 0; c < C; ++c) {
      if (c < valid) {
        const int64_t row = (first_row + c) * H + h;
        std::copy_n(q_in + row * K, K, q.data() + c * K);
        std::copy_n(k_in + row * K, K, k.data() + c * K);
        std::copy_n(g_in + row * K, K, G.data() + c * K);
        std::copy_n(v_in + row * V, V, v.data() + c * V);
        beta[c] = beta_in[row];
      } else {
        std::fill_n(q.data() + c * K, K, 0.0f);
        std::fill_n(k.data() + c * K, K, 0.0f);
        std::fill_n(G.data() + c * K, K, 0.0f);
        std::fill_n(v.data() + c * V, V, 0.0f);
        beta[c] = 0.0f;
      }
    }
    build(opt);
  }

  __attribute__((target("avx2,fma"))) void build(const ChunkOptions& opt) {
    for (int64_t c = 0; c < C; ++c) {  // L2 norm (fla's x / sqrt(sum x^2 + eps)) and q's scale
      float* qc = q.data() + c * K;
      float* kc = k.data() + c * K;
      q_factor[c] = opt.scale, k_factor[c] = 1.0f;
      if (opt.l2norm) {
        float sq[1], sk[1];
        row_dots(qc, qc, 1, K, sq);
        row_dots(kc, kc, 1, K, sk);
        q_factor[c] = opt.scale / std::sqrt(sq[0] + opt.eps);
        k_factor[c] = 1.0f / std::sqrt(sk[0] + opt.eps);
      }
      for (int64_t j = 0; j < K; ++j) qc[j] *= q_factor[c], kc[j] *= k_factor[c];
    }
    for (int64_t c = 1; c < C; ++c) {  // G: in-chunk cumulative sum (G holds g on entry)
      for (int64_t j = 0; j < K; ++j) G[c * K + j] += G[(c - 1) * K + j];
    }
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t j = 0; j < K; ++j) local[c * K + j] = G[c * K + j] - G[j];
    }
    exp_into(local.data(), down.data(), C * K);  // in [e^-80, 1]
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t j = 0; j < K; ++j) {
        const int64_t at = c * K + j;
        left_q()[at] = q[at] * down[at];
        left_k()[at] = k[at] * down[at];
        k_over[at] = k[at] / down[at];
        k_over_t[j * C + c] = k_over[at];
      }
    }
    run({2 * C, C, K, plain(left.data(), K), k_over_t.data(), 1.0f, nullptr, nullptr, P()});  // [P; Sk]
    // P keeps its lower triangle with the diagonal. T = (I + A)^-1 by forward substitution, with
    // A[i, m] = beta_i Sk[i, m] for m < i; then its columns times beta_j
    std::fill(t_inv.begin(), t_inv.end(), 0.0f);
    for (int64_t i = 0; i < C; ++i) {
      for (int64_t j = i + 1; j < C; ++j) P()[i * C + j] = 0.0f;
      float* Ti = t_inv.data() + i * C;
      Ti[i] = 1.0f;
      for (int64_t m = 0; m < i; ++m) {  // T[i, :] -= A[i, m] T[m, :] (T[m, :] ends at m)
        const float a = beta[i] * Sk()[i * C + m];
        const float* Tm = t_inv.data() + m * C;
        for (int64_t j = 0; j <= m; ++j) Ti[j] -= a * Tm[j];
      }
    }
    for (int64_t i = 0; i < C * C; ++i) t_beta[i] = t_inv[i] * beta[i % C];
    exp_into(G.data(), first.data(), K);
    exp_into(local.data() + (C - 1) * K, last.data(), K);
    exp_into(G.data() + (C - 1) * K, decay.data(), K);
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t j = 0; j < K; ++j) {
        const int64_t at = c * K + j;
        q_gamma()[at] = left_q()[at] * first[j];  // q Gamma = q exp(G)
        k_gamma[at] = left_k()[at] * first[j];
        k_hat[at] = k_over[at] * last[j];  // k exp(G_last - G)
      }
    }
    run({C, K, C, plain(t_beta.data(), C), k_gamma.data(), 1.0f, nullptr, nullptr, w()});
    run({C, V, C, plain(t_beta.data(), C), v.data(), 1.0f, nullptr, nullptr, u_in.data()});
  }
};

// One chunk of the recurrence from state S: u = U - W S, S_next = Gamma_C S + K_hat^T u (S_next may be
// S itself), and, if `o` is given ([2C, V] of room: o is its first C rows), o = (q Gamma) S + P u, with
// [q Gamma; W] S as one product.
__attribute__((target("avx2,fma"))) void chunk_step(ChunkTerms& t, float* S, float* S_next, float* u, float* o) {
  const int64_t C = t.C, K = t.K, V = t.V;
  if (o) {
    run({2 * C, V, K, plain(t.reading.data(), K), S, 1.0f, nullptr, nullptr, o});
    for (int64_t i = 0; i < C * V; ++i) u[i] = t.u_in[i] - o[C * V + i];
  } else {
    run({C, V, K, plain(t.w(), K), S, -1.0f, t.u_in.data(), nullptr, u});
  }
  run({K, V, C, transposed(t.k_hat.data(), K), u, 1.0f, S, t.decay.data(), S_next});
  if (o) run({C, V, C, plain(t.P(), C), u, 1.0f, o, nullptr, o});
}

struct TokenLayout {  // checked pointers into the token-layout tensors of one call
  int64_t rows, H, K, V, N;
  Sequences seqs;
};

TokenLayout check_token_layout(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& g, const torch::Tensor& beta, const torch::Tensor& starts,
                               const torch::Tensor& lengths, const torch::Tensor& state, int64_t chunk_size) {
  check(q, 3, "q");
  check(k, 3, "k");
  check(v, 3, "v");
  check(g, 3, "g");
  check(beta, 2, "beta");
  check(state, 4, "initial_state");
  const int64_t rows = q.size(0), H = q.size(1), K = q.size(2), V = v.size(2), N = starts.numel();
  TORCH_CHECK(k.sizes() == q.sizes() && g.sizes() == q.sizes(), "k and g must have q's shape [rows, H, K]");
  TORCH_CHECK(v.size(0) == rows && v.size(1) == H && beta.size(0) == rows && beta.size(1) == H,
              "v must be [rows, H, V] and beta [rows, H]");
  TORCH_CHECK(state.sizes() == torch::IntArrayRef({N, H, K, V}), "initial_state must be [N, H, K, V]");
  TORCH_CHECK(chunk_size >= 1 && chunk_size <= 64, "chunk_size must be in [1, 64]");
  TORCH_CHECK(starts.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64 &&
                  starts.is_contiguous() && lengths.is_contiguous() && lengths.numel() == N,
              "starts and lengths must be contiguous int64 [N]");
  const Sequences seqs{starts.data_ptr<int64_t>(), lengths.data_ptr<int64_t>()};
  int64_t end = 0;  // sequences in order, disjoint (threads write their rows), covering [0, rows)
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(seqs.start[n] == end && seqs.length[n] >= 0, "sequence ", n, " does not start where the one ",
                "before it ends");
    end += seqs.length[n];
  }
  TORCH_CHECK(end == rows, "the sequences cover ", end, " rows, not all ", rows);
  return {rows, H, K, V, N, seqs};
}

// o [rows, H, V] and final states [N, H, K, V] from fla's token layout. Parallel over (sequence, head).
std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& v, const torch::Tensor& g,
                                                 const torch::Tensor& beta, const torch::Tensor& starts,
                                                 const torch::Tensor& lengths, const torch::Tensor& initial_state,
                                                 int64_t chunk_size, double scale, bool l2norm, double eps) {
  const TokenLayout l = check_token_layout(q, k, v, g, beta, starts, lengths, initial_state, chunk_size);
  auto o = torch::empty({l.rows, l.H, l.V}, q.options());  // every row is some sequence's
  auto final_state = initial_state.clone();
  const ChunkOptions opt{chunk_size, static_cast<float>(scale), l2norm, static_cast<float>(eps)};
  at::parallel_for(0, l.N * l.H, 1, [&](int64_t z0, int64_t z1) {
    const int64_t C = opt.C;
    ChunkTerms t(C, l.K, l.V);
    std::vector<float> u(C * l.V), o_chunk(2 * C * l.V);
    for (int64_t z = z0; z < z1; ++z) {
      const int64_t n = z / l.H, h = z % l.H, start = l.seqs.start[n], length = l.seqs.length[n];
      float* S = final_state.data_ptr<float>() + z * l.K * l.V;
      for (int64_t c0 = 0; c0 < length; c0 += C) {
        const int64_t valid = std::min(C, length - c0);
        t.load(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
               beta.data_ptr<float>(), l.H, start + c0, valid, h, opt, start + c0 + C,
               std::min(C, std::max<int64_t>(0, length - c0 - C)));
        chunk_step(t, S, S, u.data(), o_chunk.data());
        for (int64_t c = 0; c < valid; ++c) {
          std::copy_n(o_chunk.data() + c * l.V, l.V, o.data_ptr<float>() + ((start + c0 + c) * l.H + h) * l.V);
        }
      }
    }
  });
  return {o, final_state};
}

// One thread's gradient scratch for one chunk. [C, K] unless noted.
struct ChunkGrads {
  std::vector<float> outer;           // [2C, V]: d_o, then -du (what multiplies [q Gamma; W])
  std::vector<float> dq_gamma_w;      // [2C, K]: d(q Gamma), then dW
  std::vector<float> dscores;         // [2C, C]: dP, then dSk
  std::vector<float> dleft;           // [2C, K]: d left_q, then d left_k (later d of the normalised q, k)
  std::vector<float> dT_beta, dT, tmp, dA;  // [C, C]
  std::vector<float> dk_hat, dk_gamma, dv, dk_over, dG;  // dv [C, V]
  std::vector<float> d_decay, d_first, d_last;  // [K]
  std::vector<float> dbeta, dots;     // [C]
  std::vector<float> state_t;         // [V, K]: S^T, then dS^T
  ChunkGrads(int64_t C, int64_t K, int64_t V)
      : outer(2 * C * V), dq_gamma_w(2 * C * K), dscores(2 * C * C), dleft(2 * C * K), dT_beta(C * C),
        dT(C * C), tmp(C * C), dA(C * C), dk_hat(C * K), dk_gamma(C * K), dv(C * V), dk_over(C * K), dG(C * K),
        d_decay(K), d_first(K), d_last(K), dbeta(C), dots(C), state_t(V * K) {}

  float* d_o() { return outer.data(); }
  float* minus_du() { return outer.data() + outer.size() / 2; }
  float* dq_gamma() { return dq_gamma_w.data(); }
  float* dw() { return dq_gamma_w.data() + dq_gamma_w.size() / 2; }
  float* dP() { return dscores.data(); }
  float* dSk() { return dscores.data() + dscores.size() / 2; }
  float* dleft_q() { return dleft.data(); }
  float* dleft_k() { return dleft.data() + dleft.size() / 2; }
};

// Gradients of one chunk, from the state S at its start, its pseudo values u [C, V], dS = dL/d(state
// after it) (updated in place to dL/dS) and d_o (in d): the recurrence's products as in state_backward
// plus o's P u, then the terms backwards to dq, dk, dv, dG (w.r.t. the cumulative log-decay) and dbeta,
// in d.
__attribute__((target("avx2,fma"))) void chunk_backward(ChunkTerms& t, ChunkGrads& d, const float* S,
                                                       const float* u, float* dS, const ChunkOptions& opt) {
  const int64_t C = t.C, K = t.K, V = t.V;
  // -du = -(P^T d_o + K_hat dS); dP = d_o u^T (lower triangle); [d(q Gamma); dW] = [d_o; -du] S^T;
  // dK_hat = u dS^T; dGamma_C = sum_V S * dS; then dS <- Gamma_C dS + [q Gamma; W]^T [d_o; -du]
  run({C, V, C, transposed(t.P(), C), d.d_o(), -1.0f, nullptr, nullptr, d.minus_du()});
  run({C, V, K, plain(t.k_hat.data(), K), dS, -1.0f, d.minus_du(), nullptr, d.minus_du()});
  product_with_transpose(d.d_o(), u, C, C, V, 1.0f, d.dP());
  transpose_into(S, K, V, d.state_t.data());  // products with S^T and dS^T as plain ones
  run({2 * C, K, V, plain(d.outer.data(), V), d.state_t.data(), 1.0f, nullptr, nullptr, d.dq_gamma_w.data()});
  transpose_into(dS, K, V, d.state_t.data());
  run({C, K, V, plain(u, V), d.state_t.data(), 1.0f, nullptr, nullptr, d.dk_hat.data()});
  row_dots(S, dS, K, V, d.d_decay.data());
  run({K, V, 2 * C, transposed(t.reading.data(), K), d.outer.data(), 1.0f, dS, t.decay.data(), dS});
  // W = T_beta k Gamma, U = T_beta v: dT_beta = dW (k Gamma)^T + dU v^T; d(k Gamma) = T_beta^T dW; dv = T_beta^T dU
  product_with_transpose(d.dw(), t.k_gamma.data(), C, C, K, 1.0f, d.dT_beta.data());
  product_with_transpose(d.minus_du(), t.v.data(), C, C, V, -1.0f, d.dT_beta.data(), true);
  run({C, K, C, transposed(t.t_beta.data(), C), d.dw(), 1.0f, nullptr, nullptr, d.dk_gamma.data()});
  run({C, V, C, transposed(t.t_beta.data(), C), d.minus_du(), -1.0f, nullptr, nullptr, d.dv.data()});
  // T_beta = T diag(beta); T = (I + A)^-1 so dA = -T^T dT T^T (strict lower part); A = diag(beta) Sk
  std::fill(d.dbeta.begin(), d.dbeta.end(), 0.0f);
  for (int64_t i = 0; i < C; ++i) {
    for (int64_t j = 0; j < C; ++j) {
      d.dT[i * C + j] = d.dT_beta[i * C + j] * t.beta[j];
      d.dbeta[j] += d.dT_beta[i * C + j] * t.t_inv[i * C + j];
    }
  }
  run({C, C, C, transposed(t.t_inv.data(), C), d.dT.data(), 1.0f, nullptr, nullptr, d.tmp.data()});
  product_with_transpose(d.tmp.data(), t.t_inv.data(), C, C, C, -1.0f, d.dA.data());
  for (int64_t i = 0; i < C; ++i) {
    for (int64_t j = 0; j < C; ++j) {
      const bool strict = j < i;
      d.dbeta[i] += strict ? d.dA[i * C + j] * t.Sk()[i * C + j] : 0.0f;
      d.dSk()[i * C + j] = strict ? t.beta[i] * d.dA[i * C + j] : 0.0f;
      if (j > i) d.dP()[i * C + j] = 0.0f;  // P is its lower triangle
    }
  }
  // [P; Sk] = [left_q; left_k] k_over^T: d left = [dP; dSk] k_over, dk_over = [dP; dSk]^T [left_q; left_k]
  run({2 * C, K, C, plain(d.dscores.data(), C), t.k_over.data(), 1.0f, nullptr, nullptr, d.dleft.data()});
  run({C, K, 2 * C, transposed(d.dscores.data(), C), t.left.data(), 1.0f, nullptr, nullptr, d.dk_over.data()});
  // elementwise: K_hat = k_over last, q Gamma = left_q first, k Gamma = left_k first, left = x down,
  // k_over = k / down, down = exp(local), last = exp(local_last), first = exp(G_0), Gamma_C = exp(G_last)
  std::fill(d.d_first.begin(), d.d_first.end(), 0.0f);
  std::fill(d.d_last.begin(), d.d_last.end(), 0.0f);
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t at = c * K + j;
      d.d_last[j] += d.dk_hat[at] * t.k_over[at];
      d.d_first[j] += d.dq_gamma()[at] * t.left_q()[at] + d.dk_gamma[at] * t.left_k()[at];
      const float dk_over = d.dk_over[at] + d.dk_hat[at] * t.last[j];
      const float dleft_q = d.dleft_q()[at] + d.dq_gamma()[at] * t.first[j];
      const float dleft_k = d.dleft_k()[at] + d.dk_gamma[at] * t.first[j];
      const float down = t.down[at];
      const float d_down = dleft_q * t.q[at] + dleft_k * t.k[at];
      const float d_up = dk_over * t.k[at];
      d.dleft_q()[at] = dleft_q * down;                 // now d(normalised q)
      d.dleft_k()[at] = dleft_k * down + dk_over / down;  // now d(normalised k)
      d.dG[at] = d_down * down - d_up / down;           // d local, for now
    }
  }
  for (int64_t j = 0; j < K; ++j) d.dG[(C - 1) * K + j] += d.d_last[j] * t.last[j];
  for (int64_t j = 0; j < K; ++j) d.dG[j] = 0.0f;  // local = G - G_0 (so local_0 = 0 whatever G_0)
  for (int64_t c = 1; c < C; ++c) {
    for (int64_t j = 0; j < K; ++j) d.dG[j] -= d.dG[c * K + j];
  }
  for (int64_t j = 0; j < K; ++j) {
    d.dG[j] += d.d_first[j] * t.first[j];
    d.dG[(C - 1) * K + j] += d.d_decay[j] * t.decay[j];
  }
  // the L2 norm (and scale): x_n = f x with f = s / sqrt(|x|^2 + eps): dx = f (dx_n - x_n (x_n . dx_n) / s^2)
  for (int pass = 0; pass < 2; ++pass) {
    float* dx = pass == 0 ? d.dleft_q() : d.dleft_k();
    const float* xn = pass == 0 ? t.q.data() : t.k.data();
    const float* f = pass == 0 ? t.q_factor.data() : t.k_factor.data();
    const float inv_s2 = pass == 0 ? 1.0f / (opt.scale * opt.scale) : 1.0f;
    if (opt.l2norm) row_dots(xn, dx, C, K, d.dots.data());
    for (int64_t c = 0; c < C; ++c) {
      const float along = opt.l2norm ? d.dots[c] * inv_s2 : 0.0f;
      for (int64_t j = 0; j < K; ++j) dx[c * K + j] = f[c] * (dx[c * K + j] - xn[c * K + j] * along);
    }
  }
}

// (dq, dk, dv, dg, dbeta, d initial state) in the token layout: per (sequence, head), the states at
// every chunk start and the pseudo values are recomputed forwards (kept in per-thread buffers), then
// the chunks are walked backwards, each rebuilding its terms. Parallel over (sequence, head).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> backward(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
    const torch::Tensor& beta, const torch::Tensor& starts, const torch::Tensor& lengths,
    const torch::Tensor& initial_state, const torch::Tensor& d_o, const torch::Tensor& d_final,
    int64_t chunk_size, double scale, bool l2norm, double eps) {
  const TokenLayout l = check_token_layout(q, k, v, g, beta, starts, lengths, initial_state, chunk_size);
  check(d_o, 3, "d_o");
  check(d_final, 4, "d_final");
  TORCH_CHECK(d_o.sizes() == v.sizes() && d_final.sizes() == initial_state.sizes(),
              "d_o must have v's shape and d_final the state's");
  auto dq = torch::empty_like(q), dk = torch::empty_like(k), dv = torch::empty_like(v);
  auto dg = torch::empty_like(g), dbeta = torch::empty_like(beta);
  auto d_state = d_final.clone();
  const ChunkOptions opt{chunk_size, static_cast<float>(scale), l2norm, static_cast<float>(eps)};
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>(), *dop = d_o.data_ptr<float>();
  at::parallel_for(0, l.N * l.H, 1, [&](int64_t z0, int64_t z1) {
    const int64_t C = opt.C, K = l.K, V = l.V, H = l.H;
    ChunkTerms t(C, K, V);
    ChunkGrads d(C, K, V);
    std::vector<float> states, pseudo_values, running(K);  // per chunk: S at its start [K, V], u [C, V]
    for (int64_t z = z0; z < z1; ++z) {
      const int64_t n = z / H, h = z % H, start = l.seqs.start[n], length = l.seqs.length[n];
      const int64_t chunks = (length + C - 1) / C;
      states.resize((chunks + 1) * K * V);  // the last one is the final state, written but not read
      pseudo_values.resize(chunks * C * V);
      std::copy_n(initial_state.data_ptr<float>() + z * K * V, K * V, states.data());
      for (int64_t i = 0; i < chunks; ++i) {
        const int64_t first_row = start + i * C;
        t.load(qp, kp, vp, gp, bp, H, first_row, std::min(C, length - i * C), h, opt, first_row + C,
               std::min(C, std::max<int64_t>(0, length - (i + 1) * C)));
        float* S_i = states.data() + i * K * V;
        chunk_step(t, S_i, S_i + K * V, pseudo_values.data() + i * C * V, nullptr);
      }
      float* dS = d_state.data_ptr<float>() + z * K * V;
      for (int64_t i = chunks - 1; i >= 0; --i) {
        const int64_t first_row = start + i * C, valid = std::min(C, length - i * C);
        const float* S_i = states.data() + i * K * V;
        t.load(qp, kp, vp, gp, bp, H, first_row, valid, h, opt, first_row - C, i > 0 ? C : 0);
        for (int64_t c = 0; c < C; ++c) {
          float* row = d.d_o() + c * V;
          if (c < valid) {
            std::copy_n(dop + ((first_row + c) * H + h) * V, V, row);
          } else {
            std::fill_n(row, V, 0.0f);
          }
        }
        chunk_backward(t, d, S_i, pseudo_values.data() + i * C * V, dS, opt);
        std::fill(running.begin(), running.end(), 0.0f);  // dg: reverse cumulative sum of dG
        for (int64_t c = C - 1; c >= 0; --c) {
          for (int64_t j = 0; j < K; ++j) running[j] += d.dG[c * K + j];
          if (c >= valid) continue;
          const int64_t row = (first_row + c) * H + h;
          std::copy_n(d.dleft_q() + c * K, K, dq.data_ptr<float>() + row * K);
          std::copy_n(d.dleft_k() + c * K, K, dk.data_ptr<float>() + row * K);
          std::copy_n(running.data(), K, dg.data_ptr<float>() + row * K);
          std::copy_n(d.dv.data() + c * V, V, dv.data_ptr<float>() + row * V);
          dbeta.data_ptr<float>()[row] = d.dbeta[c];
        }
      }
    }
  });
  return {dq, dk, dv, dg, dbeta, d_state};
}

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "k3 KDA native CPU kernels (AVX2 + FMA): the fused chunked forward and backward, the state loops";
  m.def("state_forward", &state_forward, "(reads, u, final state) of the chunk recurrence",
        py::arg("q_gamma"), py::arg("w"), py::arg("u_in"), py::arg("k_hat"), py::arg("decay"),
        py::arg("state"));
  m.def("state_history", &state_history, "[steps + 1, Z, K, V] states from the first state and u",
        py::arg("k_hat"), py::arg("u"), py::arg("decay"), py::arg("state"));
  m.def("state_backward", &state_backward,
        "(d q_gamma, d w, d u_in, d k_hat, d decay, d state): every gradient of the recurrence",
        py::arg("q_gamma"), py::arg("w"), py::arg("k_hat"), py::arg("decay"), py::arg("u"), py::arg("states"),
        py::arg("d_reads"), py::arg("d_u"), py::arg("d_final"));
  m.def("forward", &forward, "(o, final states): the chunked forward from the token layout, no gradients",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("starts"),
        py::arg("lengths"), py::arg("initial_state"), py::arg("chunk_size"), py::arg("scale"), py::arg("l2norm"),
        py::arg("eps"));
  m.def("backward", &backward,
        "(dq, dk, dv, dg, dbeta, d initial state) of `forward`, in the token layout", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("starts"), py::arg("lengths"),
        py::arg("initial_state"), py::arg("d_o"), py::arg("d_final"), py::arg("chunk_size"), py::arg("scale"),
        py::arg("l2norm"), py::arg("eps"));
  m.def("cpu_supported", &cpu_supported, "whether this CPU has AVX2 and FMA");
  m.attr("source_hash") = K3_STRINGIFY_VALUE(K3_NATIVE_SOURCE_HASH);
}
