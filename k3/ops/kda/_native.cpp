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
//    in scratch memory, then runs the step above and o = reads + P u. For training, the forward also
//    keeps every chunk's starting state and pseudo values (else the backward recomputes them); the
//    backward walks the chunks backwards through the adjoint of every step.
//
// Why native: per chunk these are [16 x 128] x [128 x 128] products, too small for torch's batched
// matmul to run near GEMM speed (~65 of ~190 GFLOP/s here), and torch pays a few microseconds of
// dispatch per op and a pass over memory per elementwise step. Here the state stays in its core's
// cache and every product is one register-blocked kernel that also applies the decay and the
// accumulation: 16-lane (AVX-512) where the CPU has it, else 8-lane (AVX2/FMA), the same bits
// (_native_products512.h; `variant` chooses, for tests).
//
// Layouts (contiguous fp32): q_gamma, w, k_hat [steps, Z, C, K]; u_in, reads, u, d_* [steps, Z, C, V];
// decay [steps, Z, K]; states [Z, K, V]; `forward` takes fla's token layout q, k, g [rows, H, K],
// v [rows, H, V], beta [rows, H], and keeps chunk-start states transposed [chunks, V, K] and pseudo
// values [chunks, C, V], chunks ordered by (sequence, head, chunk). AVX2 + FMA per function
// (__attribute__((target))), so the module loads on any x86-64 CPU; `cpu_supported()` tells Python
// whether the kernels may be called.

#include <torch/extension.h>

#include "_native_common.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "_native_chunk.h"
#include "_native_decode.h"
#include "_native_products512.h"


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
    const torch::Tensor& k_hat, const torch::Tensor& decay, const torch::Tensor& state, const std::string& variant) {
  const Shape s = check_shapes(q_gamma, w, k_hat, decay, u_in, state);
  const bool wide = wide_products(variant);
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
             reads.data_ptr<float>() + at * cv}, wide);
        run({s.C, s.V, s.K, plain(w.data_ptr<float>() + at * ck, s.K), S, -1.0f,
             u_in.data_ptr<float>() + at * cv, nullptr, u_i}, wide);
        run({s.K, s.V, s.C, transposed(k_hat.data_ptr<float>() + at * ck, s.K), u_i, 1.0f, S,
             decay.data_ptr<float>() + at * s.K, S}, wide);
      }
    }
  });
  return {reads, u, final_state};
}

// [steps + 1, Z, K, V]: every chunk's starting state and the final one, from the first state and u.
torch::Tensor state_history(const torch::Tensor& k_hat, const torch::Tensor& u, const torch::Tensor& decay,
                            const torch::Tensor& state, const std::string& variant) {
  const Shape s = check_shapes(k_hat, k_hat, k_hat, decay, u, state);
  const bool wide = wide_products(variant);
  auto states = torch::empty({s.steps + 1, s.Z, s.K, s.V}, state.options());
  states[0].copy_(state);
  const int64_t kv = s.K * s.V, ck = s.C * s.K, cv = s.C * s.V;
  at::parallel_for(0, s.Z, 1, [&](int64_t z0, int64_t z1) {
    for (int64_t z = z0; z < z1; ++z) {
      for (int64_t i = 0; i < s.steps; ++i) {
        const int64_t at = i * s.Z + z;
        float* before = states.data_ptr<float>() + at * kv;
        run({s.K, s.V, s.C, transposed(k_hat.data_ptr<float>() + at * ck, s.K), u.data_ptr<float>() + at * cv,
             1.0f, before, decay.data_ptr<float>() + at * s.K, before + s.Z * kv}, wide);
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
               const torch::Tensor& d_reads, const torch::Tensor& d_u, const torch::Tensor& d_final,
               const std::string& variant) {
  const Shape s = check_shapes(q_gamma, w, k_hat, decay, d_reads, d_final);
  const bool wide = wide_products(variant);
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
             d_u.data_ptr<float>() + at * cv, nullptr, du_i}, wide);
        transpose(dS, s.K, s.V, state_t.data(), wide);  // products with dS^T and S^T as plain ones
        run({s.C, s.K, s.V, plain(u.data_ptr<float>() + at * cv, s.V), state_t.data(), 1.0f, nullptr, nullptr,
             d_k_hat.data_ptr<float>() + at * ck}, wide);
        row_dots(S, dS, s.K, s.V, d_decay.data_ptr<float>() + at * s.K);
        transpose(S, s.K, s.V, state_t.data(), wide);
        run({s.C, s.K, s.V, plain(dR, s.V), state_t.data(), 1.0f, nullptr, nullptr,
             d_q_gamma.data_ptr<float>() + at * ck}, wide);
        run({s.C, s.K, s.V, plain(du_i, s.V), state_t.data(), -1.0f, nullptr, nullptr,
             d_w.data_ptr<float>() + at * ck}, wide);
        run({s.K, s.V, s.C, transposed(q_gamma.data_ptr<float>() + at * ck, s.K), dR, 1.0f, dS, gamma, dS}, wide);
        run({s.K, s.V, s.C, transposed(w.data_ptr<float>() + at * ck, s.K), du_i, -1.0f, dS, nullptr, dS}, wide);
      }
    }
  });
  return {d_q_gamma, d_w, du, d_k_hat, d_decay, d_state};
}

// ---------------------------------------------------------------- the fused chunked form, token layout in and out

// Where the sequences lie in the token layout: sequence n is rows [start[n], start[n] + length[n]), one
// after the other, covering every row.
struct Sequences {
  const int64_t* start;
  const int64_t* length;
};

struct TokenLayout {  // one call's checked token-layout inputs: sizes, sequences, data
  int64_t rows, H, K, V, N;
  Sequences seqs;
  const float *q, *k, *v, *g, *beta;
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
  return {rows, H, K, V, N, seqs, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
          g.data_ptr<float>(), beta.data_ptr<float>()};
}

// Where each (sequence, head)'s chunks lie in the buffers kept for the backward: chunk i of z = n H + h
// is entry first[z] + i, the sequences' heads one after another; first[N H] counts them all.
std::vector<int64_t> chunk_offsets(const TokenLayout& l, int64_t C) {
  std::vector<int64_t> first(l.N * l.H + 1, 0);
  for (int64_t z = 0; z < l.N * l.H; ++z) first[z + 1] = first[z] + (l.seqs.length[z / l.H] + C - 1) / C;
  return first;
}

// `forward`'s refusal of a g out of [g_floor, 0] (Python: the module's GateOutOfRange, a ValueError), which
// chunk.py answers with its torch path.
struct GateOutOfRange : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// One thread's scratch for the forward, besides the chunk's terms.
struct StepScratch {
  std::vector<float> u, o;  // [C, V], [2C, V] (see chunk_step)
  StepScratch(int64_t C, int64_t V) : u(C * V), o(2 * C * V) {}
};

// A thread runs its heads of a sequence in groups of up to kHeadsTogether, chunk by chunk (for each chunk,
// each head of the group), not one head's chunks after another's: a token's rows of the group's heads lie
// side by side (16 x 128 floats, two pages), which the hardware prefetchers follow, where one head's rows
// were 512 bytes on a page each. The group's states (64 KB a head at K3's shapes) stay in L2 / L3. Measured
// on Zen 3 (T = 4,096, two threads, same bits): the forward about 5 % faster at H = 8 (four heads a thread),
// 11-13 % at H = 96, the backward 2-6 %.
constexpr int64_t kHeadsTogether = 16;

// fn(n, h0, h1) for the groups of at most `most` heads of one sequence that cover z = n H + h in [z0, z1).
template <typename F>
void for_head_groups(int64_t z0, int64_t z1, int64_t H, int64_t most, const F& fn) {
  for (int64_t z = z0; z < z1;) {
    const int64_t n = z / H, h0 = z % H, h1 = std::min({H, h0 + most, h0 + (z1 - z)});
    fn(n, h0, h1);
    z += h1 - h0;
  }
}

// Runs sequence n's chunks of heads [h0, h1) forwards from their states S ([h1 - h0, K, V], left as the
// final states): writes o's rows if `o` is given, and if `kept_states` is, keeps chunk i's starting state
// of the group's head j transposed ([V, K]: the backward's products take S^T) at kept_states + (j chunks +
// i) V K and its pseudo values at kept_u + (j chunks + i) C V. Both are streamed past the cache (nothing
// reads them before the backward), the states transposed on their way out (transpose_streamed: on Zen 3
// this took the cost of keeping from 19.6 to 4.8 ms over a one-thread forward of 75 ms at T = 4,096, H = 8,
// against a transpose into scratch memory, a stream_copy of it and the pseudo values written by the
// products). Stops early, returning false, where a chunk's g leaves [opt.g_floor, 0] (it then sets
// `refused`) or another thread's did (`refused` is set): the call's results are then not used.
bool forward_sequence_heads(const TokenLayout& l, int64_t n, int64_t h0, int64_t h1, const ChunkOptions& opt,
                            ChunkTerms& t, StepScratch& scratch, float* S, float* o, float* kept_states,
                            float* kept_u, std::atomic<bool>& refused) {
  const int64_t C = opt.C, K = l.K, V = l.V, start = l.seqs.start[n], length = l.seqs.length[n];
  const int64_t chunks = (length + C - 1) / C;
  for (int64_t i = 0, c0 = 0; c0 < length; ++i, c0 += C) {
    if (refused.load(std::memory_order_relaxed)) return false;
    const int64_t valid = std::min(C, length - c0);
    for (int64_t h = h0; h < h1; ++h) {
      // the chunk loaded next: this chunk of the next head, or the next chunk of the group's first head
      const bool same_chunk = h + 1 < h1;
      const int64_t j = h - h0, next_c0 = same_chunk ? c0 : c0 + C, next_h = same_chunk ? h + 1 : h0;
      if (!t.load(l.q, l.k, l.v, l.g, l.beta, l.H, start + c0, valid, h, opt, start + next_c0,
                  std::min(C, std::max<int64_t>(0, length - next_c0)), next_h, true)) {
        refused.store(true, std::memory_order_relaxed);
        return false;
      }
      float* S_h = S + j * K * V;
      if (kept_states) transpose_streamed(S_h, K, V, kept_states + (j * chunks + i) * V * K);
      chunk_step(t, opt.wide, S_h, S_h, scratch.u.data(), o ? scratch.o.data() : nullptr);
      if (kept_u) stream_copy(scratch.u.data(), kept_u + (j * chunks + i) * C * V, C * V);
      for (int64_t c = 0; o && c < valid; ++c) {
        std::copy_n(scratch.o.data() + c * V, V, o + ((start + c0 + c) * l.H + h) * V);
      }
    }
  }
  return true;
}

// o [rows, H, V] and final states [N, H, K, V] from fla's token layout; with `keep`, also every chunk's
// starting state, transposed [chunks, V, K], and pseudo values [chunks, C, V] for the backward (else
// empty tensors). Parallel over (sequence, head). Throws GateOutOfRange, having stopped at the first chunk
// out of range, where a g lies outside [g_floor, 0].
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> forward(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
    const torch::Tensor& beta, const torch::Tensor& starts, const torch::Tensor& lengths,
    const torch::Tensor& initial_state, int64_t chunk_size, double g_floor, double scale, bool l2norm, double eps,
    bool keep, const std::string& variant) {
  const TokenLayout l = check_token_layout(q, k, v, g, beta, starts, lengths, initial_state, chunk_size);
  auto o = k3_native::empty_on_huge_pages({l.rows, l.H, l.V}, q.options());  // every row is some sequence's
  auto final_state = initial_state.clone();
  const ChunkOptions opt{chunk_size, static_cast<float>(g_floor), static_cast<float>(scale), l2norm,
                         static_cast<float>(eps), wide_products(variant)};
  const std::vector<int64_t> first = chunk_offsets(l, opt.C);
  const int64_t kept = keep ? first.back() : 0;
  auto states = k3_native::empty_on_huge_pages({kept, l.V, l.K}, q.options());
  auto pseudo_values = k3_native::empty_on_huge_pages({kept, opt.C, l.V}, q.options());
  std::atomic<bool> refused{false};
  at::parallel_for(0, l.N * l.H, 1, [&](int64_t z0, int64_t z1) {
    ChunkTerms t(opt.C, l.K, l.V);
    StepScratch scratch(opt.C, l.V);
    for_head_groups(z0, z1, l.H, kHeadsTogether, [&](int64_t n, int64_t h0, int64_t h1) {
      const int64_t z = n * l.H + h0;
      float* kept_states = keep ? states.data_ptr<float>() + first[z] * l.V * l.K : nullptr;
      float* kept_u = keep ? pseudo_values.data_ptr<float>() + first[z] * opt.C * l.V : nullptr;
      forward_sequence_heads(l, n, h0, h1, opt, t, scratch, final_state.data_ptr<float>() + z * l.K * l.V,
                             o.data_ptr<float>(), kept_states, kept_u, refused);
    });
    _mm_sfence();  // the streamed states are visible before the backward reads them
  });
  if (refused) {
    throw GateOutOfRange("g leaves [" + std::to_string(g_floor) + ", 0] in some chunk: one base chunk of " +
                         std::to_string(chunk_size) + " tokens cannot take it");
  }
  return {o, final_state, states, pseudo_values};
}

// (dq, dk, dv, dg, dbeta, d initial state) in the token layout, per (sequence, head): the chunks walked
// backwards, each rebuilding its terms, from the chunk-start states and pseudo values `forward` kept
// (`states` [chunks, V, K], `pseudo_values` [chunks, C, V]) or, if those are empty, recomputed forwards
// first into per-thread buffers. Parallel over (sequence, head).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> backward(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
    const torch::Tensor& beta, const torch::Tensor& starts, const torch::Tensor& lengths,
    const torch::Tensor& initial_state, const torch::Tensor& states, const torch::Tensor& pseudo_values,
    const torch::Tensor& d_o, const torch::Tensor& d_final, int64_t chunk_size, double g_floor, double scale,
    bool l2norm, double eps, const std::string& variant) {
  const TokenLayout l = check_token_layout(q, k, v, g, beta, starts, lengths, initial_state, chunk_size);
  check(d_o, 3, "d_o");
  check(d_final, 4, "d_final");
  TORCH_CHECK(d_o.sizes() == v.sizes() && d_final.sizes() == initial_state.sizes(),
              "d_o must have v's shape and d_final the state's");
  const std::vector<int64_t> first = chunk_offsets(l, chunk_size);
  check(states, 3, "states");
  check(pseudo_values, 3, "pseudo_values");
  const bool kept = states.size(0) > 0;
  const int64_t chunks_kept = kept ? first.back() : 0;
  TORCH_CHECK(states.sizes() == torch::IntArrayRef({chunks_kept, l.V, l.K}) &&
                  pseudo_values.sizes() == torch::IntArrayRef({chunks_kept, chunk_size, l.V}),
              "states must be [chunks, V, K] and pseudo_values [chunks, C, V] as `forward` keeps them, or "
              "both empty");
  auto dq = k3_native::empty_on_huge_pages(q.sizes(), q.options()), dk = k3_native::empty_on_huge_pages(k.sizes(), k.options());
  auto dv = k3_native::empty_on_huge_pages(v.sizes(), v.options()), dg = k3_native::empty_on_huge_pages(g.sizes(), g.options());
  auto dbeta = torch::empty_like(beta);
  auto d_state = torch::empty_like(d_final);  // each head's dS, transposed [V, K] during its walk
  const ChunkOptions opt{chunk_size, static_cast<float>(g_floor), static_cast<float>(scale), l2norm,
                         static_cast<float>(eps), wide_products(variant)};
  const float* dop = d_o.data_ptr<float>();
  at::parallel_for(0, l.N * l.H, 1, [&](int64_t z0, int64_t z1) {
    const int64_t C = opt.C, K = l.K, V = l.V, H = l.H;
    ChunkTerms t(C, K, V);
    ChunkGrads d(C, K, V);
    StepScratch scratch(C, V);
    std::vector<float> own_states, own_pseudo_values, S(K * V), running(K);  // used when nothing was kept
    // Heads in groups as the forward runs them, or one at a time when nothing was kept: each head's
    // states are then recomputed into this thread's buffers first.
    for_head_groups(z0, z1, H, kept ? kHeadsTogether : 1, [&](int64_t n, int64_t h0, int64_t h1) {
      const int64_t start = l.seqs.start[n], length = l.seqs.length[n], z = n * H + h0;
      const int64_t chunks = first[z + 1] - first[z];
      // chunk i of the group's head j: S^T at states_t + (j chunks + i) V K, u at u_all + (j chunks + i) C V
      const float *states_t, *u_all;
      if (kept) {
        states_t = states.data_ptr<float>() + first[z] * V * K;
        u_all = pseudo_values.data_ptr<float>() + first[z] * C * V;
      } else {
        own_states.resize(chunks * V * K);
        own_pseudo_values.resize(chunks * C * V);
        std::copy_n(initial_state.data_ptr<float>() + z * K * V, K * V, S.data());
        std::atomic<bool> refused{false};
        TORCH_CHECK(forward_sequence_heads(l, n, h0, h1, opt, t, scratch, S.data(), nullptr, own_states.data(),
                                           own_pseudo_values.data(), refused),
                    "g leaves [g_floor, 0]: the forward refuses such g");
        states_t = own_states.data();
        u_all = own_pseudo_values.data();
      }
      for (int64_t j = 0; j < h1 - h0; ++j) {
        transpose(d_final.data_ptr<float>() + (z + j) * K * V, K, V, d_state.data_ptr<float>() + (z + j) * K * V,
                  opt.wide);
      }
      for (int64_t i = chunks - 1; i >= 0; --i) {
        const int64_t first_row = start + i * C, valid = std::min(C, length - i * C);
        for (int64_t h = h0; h < h1; ++h) {
          // the chunk loaded next: this chunk of the next head, or the chunk before of the group's first head
          const bool same_chunk = h + 1 < h1;
          const int64_t j = h - h0, next_h = same_chunk ? h + 1 : h0;
          const int64_t next_row = same_chunk ? first_row : first_row - C;
          const int64_t next_valid = same_chunk ? valid : (i > 0 ? C : 0);
          TORCH_CHECK(t.load(l.q, l.k, l.v, l.g, l.beta, H, first_row, valid, h, opt, next_row, next_valid, next_h,
                             false),
                      "g leaves [g_floor, 0]: the forward refuses such g");
          for (int64_t c = 0; c < C; ++c) {
            float* row = d.d_o() + c * V;
            if (c < valid) {
              std::copy_n(dop + ((first_row + c) * H + h) * V, V, row);
            } else {
              std::fill_n(row, V, 0.0f);
            }
          }
          for (int64_t c = 0; c < next_valid; ++c) t.ahead.add(dop + ((next_row + c) * H + next_h) * V, V);
          if (next_valid > 0) {  // the next step's kept state and pseudo values
            const int64_t next_at = (next_h - h0) * chunks + (same_chunk ? i : i - 1);
            t.ahead.add(states_t + next_at * V * K, V * K);
            t.ahead.add(u_all + next_at * C * V, C * V);
          }
          float* dS_t = d_state.data_ptr<float>() + (z + j) * K * V;
          chunk_backward(t, d, states_t + (j * chunks + i) * V * K, u_all + (j * chunks + i) * C * V, dS_t, opt);
          std::fill(running.begin(), running.end(), 0.0f);  // dg: reverse cumulative sum of dG
          for (int64_t c = C - 1; c >= 0; --c) {
            for (int64_t col = 0; col < K; ++col) running[col] += d.dG[c * K + col];
            if (c >= valid) continue;
            const int64_t row = (first_row + c) * H + h;  // streamed: nothing here reads them again
            stream_copy(d.dleft_q() + c * K, dq.data_ptr<float>() + row * K, K);
            stream_copy(d.dleft_k() + c * K, dk.data_ptr<float>() + row * K, K);
            stream_copy(running.data(), dg.data_ptr<float>() + row * K, K);
            stream_copy(d.dv.data() + c * V, dv.data_ptr<float>() + row * V, V);
            dbeta.data_ptr<float>()[row] = d.dbeta[c];
          }
        }
      }
      for (int64_t j = 0; j < h1 - h0; ++j) {  // dS back to [K, V]
        float* dS = d_state.data_ptr<float>() + (z + j) * K * V;
        transpose(dS, V, K, d.state.data(), opt.wide);
        std::copy_n(d.state.data(), K * V, dS);
      }
    });
    _mm_sfence();  // the streamed gradient rows are visible before Python reads them
  });
  return {dq, dk, dv, dg, dbeta, d_state};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "k3 KDA native CPU kernels (AVX2 + FMA, AVX-512 products): the fused chunked forward and backward, the state loops";
  m.def("state_forward", &state_forward, "(reads, u, final state) of the chunk recurrence",
        py::arg("q_gamma"), py::arg("w"), py::arg("u_in"), py::arg("k_hat"), py::arg("decay"),
        py::arg("state"), py::arg("variant") = "auto");
  m.def("state_history", &state_history, "[steps + 1, Z, K, V] states from the first state and u",
        py::arg("k_hat"), py::arg("u"), py::arg("decay"), py::arg("state"), py::arg("variant") = "auto");
  m.def("state_backward", &state_backward,
        "(d q_gamma, d w, d u_in, d k_hat, d decay, d state): every gradient of the recurrence",
        py::arg("q_gamma"), py::arg("w"), py::arg("k_hat"), py::arg("decay"), py::arg("u"), py::arg("states"),
        py::arg("d_reads"), py::arg("d_u"), py::arg("d_final"), py::arg("variant") = "auto");
  m.def("forward", &forward,
        "(o, final states, kept chunk-start states, kept pseudo values): the chunked forward from the token layout",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("starts"),
        py::arg("lengths"), py::arg("initial_state"), py::arg("chunk_size"), py::arg("g_floor"), py::arg("scale"),
        py::arg("l2norm"), py::arg("eps"), py::arg("keep"), py::arg("variant") = "auto");
  m.def("backward", &backward,
        "(dq, dk, dv, dg, dbeta, d initial state) of `forward`, in the token layout", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("starts"), py::arg("lengths"),
        py::arg("initial_state"), py::arg("states"), py::arg("pseudo_values"), py::arg("d_o"), py::arg("d_final"),
        py::arg("chunk_size"), py::arg("g_floor"), py::arg("scale"), py::arg("l2norm"), py::arg("eps"),
        py::arg("variant") = "auto");
  m.def("products_variant", &products_variant, "the chunk products in use: 'avx512' or 'avx2' (the same bits)");
  m.def("decode_step", &kda_decode::decode_step,
        "(o, new conv tails q/k/v, new state): one token's short convs, L2 norms and delta-rule step",
        py::arg("x_q"), py::arg("x_k"), py::arg("x_v"), py::arg("tail_q"), py::arg("tail_k"), py::arg("tail_v"),
        py::arg("w_q"), py::arg("w_k"), py::arg("w_v"), py::arg("g"), py::arg("beta"), py::arg("state"),
        py::arg("scale"));
  py::register_exception<GateOutOfRange>(m, "GateOutOfRange", PyExc_ValueError);
  K3_NATIVE_COMMON(m);  // source_hash, cpu_supported(), cpu_features()
}
