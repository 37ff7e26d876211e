// One chunk of the fused chunked KDA (_native.cpp's `forward` and `backward`): its terms, its step of
// the recurrence and the adjoint of both, on one thread's scratch memory. chunk.py's `base_terms` and
// state_passing.py hold the same arithmetic in torch. Included by _native.cpp only.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "_native_products512.h"

namespace {

struct ChunkOptions {
  int64_t C;      // chunk size: one base chunk
  float g_floor;  // every g lies in [g_floor, 0]: (C - 1) |g| <= chunk.py's EXP_LIMIT (`load` checks)
  float scale;  // q's scale
  bool l2norm;  // L2-normalise q and k first
  float eps;    // inside the L2 norm's square root
  bool wide;    // the products in 16 lanes (AVX-512; the same bits as in 8)
};

// Whether every x[0, n) lies in [lowest, 0], NaN passing (as it passes chunk.py's checks of g). The chunk's
// g as `load` copies them, instead of a pass over all of g before the call: at T = 4,096, H = 8 on Zen 3 that
// pass (torch.aminmax) read 16 MB in 0.67 ms, 2 % of the forward; this one reads 8 kB already in L1.
__attribute__((target("avx2,fma"))) inline bool in_range(const float* x, int64_t n, float lowest) {
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {  // min / max return their second operand where the first is NaN
    const __m256 v = _mm256_loadu_ps(x + i);
    low = _mm256_min_ps(v, low);
    high = _mm256_max_ps(v, high);
  }
  bool ok = _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(low, _mm256_set1_ps(lowest), _CMP_LT_OQ),
                                            _mm256_cmp_ps(high, _mm256_setzero_ps(), _CMP_GT_OQ))) == 0;
  for (; i < n; ++i) ok = ok && !(x[i] < lowest) && !(x[i] > 0.0f);
  return ok;
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
  LineRequests ahead;  // the rows of the chunk loaded next, asked for during this chunk's products
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

  // Takes the `valid` rows from `first_row` on of head h (q and k normalised as they are read; zeros after
  // them: padding neither decays nor writes) and builds the terms; returns false, with nothing built, where a
  // g of these rows is above 0 or below opt.g_floor (chunk.py's torch path then takes the call, in smaller
  // base chunks). The `next_valid` rows from `next_first_row` on of head `next_h` (the chunk to be loaded
  // next) go into `ahead`, asked for during this chunk's products: a head's rows lie H * K floats apart, one
  // page each in K3's shapes. `with_u`: build U too (the backward reads the pseudo values kept by the forward
  // instead, so it skips U's product).
  bool load(const float* q_in, const float* k_in, const float* v_in, const float* g_in, const float* beta_in,
            int64_t H, int64_t first_row, int64_t valid, int64_t h, const ChunkOptions& opt,
            int64_t next_first_row, int64_t next_valid, int64_t next_h, bool with_u) {
    ahead.ask(ahead.lines.size());  // what is left of the requests for these rows
    ahead.clear();
    for (int64_t c = 0; c < next_valid; ++c) {
      const int64_t row = (next_first_row + c) * H + next_h;
      for (const float* p : {q_in + row * K, k_in + row * K, g_in + row * K}) ahead.add(p, K);
      ahead.add(v_in + row * V, V);
    }
    for (int64_t c = 0; c < C; ++c) {
      if (c < valid) {
        const int64_t row = (first_row + c) * H + h;
        normalise_row(q_in + row * K, opt.scale, opt, q.data() + c * K, q_factor[c]);
        normalise_row(k_in + row * K, 1.0f, opt, k.data() + c * K, k_factor[c]);
        std::copy_n(g_in + row * K, K, G.data() + c * K);
        std::copy_n(v_in + row * V, V, v.data() + c * V);
        beta[c] = beta_in[row];
      } else {
        normalise_row(nullptr, opt.scale, opt, q.data() + c * K, q_factor[c]);
        normalise_row(nullptr, 1.0f, opt, k.data() + c * K, k_factor[c]);
        std::fill_n(G.data() + c * K, K, 0.0f);
        std::fill_n(v.data() + c * V, V, 0.0f);
        beta[c] = 0.0f;
      }
    }
    if (!in_range(G.data(), C * K, opt.g_floor)) return false;  // G holds g until `build`
    build(opt, with_u);
    return true;
  }

  // dst = x f, with f = scale / sqrt(sum x^2 + eps) (fla's L2 norm, where opt.l2norm) or scale, into `factor`;
  // a row of zeros where x is nullptr (padding). Read from the input rows, not from a copy of them: a memmove
  // call a row fewer.
  __attribute__((target("avx2,fma"))) void normalise_row(const float* x, float scale, const ChunkOptions& opt,
                                                         float* dst, float& factor) const {
    float sum[1] = {0.0f};
    if (x && opt.l2norm) row_dots(x, x, 1, K, sum);
    factor = opt.l2norm ? scale / std::sqrt(sum[0] + opt.eps) : scale;
    if (x) {
      scale_copy(x, factor, K, dst);
    } else {
      std::fill_n(dst, K, 0.0f);
    }
  }

  __attribute__((target("avx2,fma"))) void build(const ChunkOptions& opt, bool with_u) {
    for (int64_t c = 1; c < C; ++c) {  // G: in-chunk cumulative sum (G holds g on entry)
      for (int64_t j = 0; j < K; ++j) G[c * K + j] += G[(c - 1) * K + j];
    }
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t j = 0; j < K; ++j) local[c * K + j] = G[c * K + j] - G[j];
    }
    exp_into(local.data(), down.data(), C * K);  // in [e^-80, 1]
    {  // the buffers are distinct (__restrict), so the compiler vectorises the pass
      const float *__restrict q_in = q.data(), *__restrict k_in = k.data(), *__restrict down_in = down.data();
      float *__restrict lq = left_q(), *__restrict lk = left_k(), *__restrict ko = k_over.data();
#pragma GCC ivdep
      for (int64_t at = 0; at < C * K; ++at) {
        lq[at] = q_in[at] * down_in[at];
        lk[at] = k_in[at] * down_in[at];
        ko[at] = k_in[at] / down_in[at];
      }
    }
    transpose(k_over.data(), C, K, k_over_t.data(), opt.wide);
    run({2 * C, C, K, plain(left.data(), K), k_over_t.data(), 1.0f, nullptr, nullptr, P()}, opt.wide);  // [P; Sk]
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
    for (int64_t i = 0; i < C; ++i) {  // row by row, so that the compiler vectorises it
      for (int64_t j = 0; j < C; ++j) t_beta[i * C + j] = t_inv[i * C + j] * beta[j];
    }
    exp_into(G.data(), first.data(), K);
    exp_into(local.data() + (C - 1) * K, last.data(), K);
    exp_into(G.data() + (C - 1) * K, decay.data(), K);
    for (int64_t c = 0; c < C; ++c) {  // q Gamma = q exp(G), k Gamma likewise, K_hat = k exp(G_last - G)
      const float *__restrict lq = left_q() + c * K, *__restrict lk = left_k() + c * K;
      const float *__restrict ko = k_over.data() + c * K, *__restrict f = first.data(), *__restrict l = last.data();
      float *__restrict qg = q_gamma() + c * K, *__restrict kg = k_gamma.data() + c * K;
      float* __restrict kh = k_hat.data() + c * K;
#pragma GCC ivdep
      for (int64_t j = 0; j < K; ++j) qg[j] = lq[j] * f[j], kg[j] = lk[j] * f[j], kh[j] = ko[j] * l[j];
    }
    run({C, K, C, plain(t_beta.data(), C), k_gamma.data(), 1.0f, nullptr, nullptr, w()}, opt.wide);
    if (with_u) run({C, V, C, plain(t_beta.data(), C), v.data(), 1.0f, nullptr, nullptr, u_in.data()}, opt.wide);
  }
};

// One chunk of the recurrence from state S: u = U - W S, S_next = Gamma_C S + K_hat^T u (S_next may be
// S itself), and, if `o` is given ([2C, V] of room: o is its first C rows), o = (q Gamma) S + P u, with
// [q Gamma; W] S as one product. `wide`: ChunkOptions::wide.
__attribute__((target("avx2,fma"))) void chunk_step(ChunkTerms& t, bool wide, float* S, float* S_next, float* u,
                                                   float* o) {
  const int64_t C = t.C, K = t.K, V = t.V;
  if (o) {
    run({2 * C, V, K, plain(t.reading.data(), K), S, 1.0f, nullptr, nullptr, o, &t.ahead}, wide);
    for (int64_t i = 0; i < C * V; ++i) u[i] = t.u_in[i] - o[C * V + i];
  } else {
    run({C, V, K, plain(t.w(), K), S, -1.0f, t.u_in.data(), nullptr, u, &t.ahead}, wide);
  }
  run({K, V, C, transposed(t.k_hat.data(), K), u, 1.0f, S, t.decay.data(), S_next, &t.ahead}, wide);
  if (o) run({C, V, C, plain(t.P(), C), u, 1.0f, o, nullptr, o}, wide);
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
  std::vector<float> k_hat_t, minus_du_t;  // K_hat^T [K, C], -du^T [V, C]
  std::vector<float> state;           // [K, V]: a head's dS taken back from the transposed layout
  std::vector<float> b_t;             // [max(K, V, C), C]: product_with_transpose's b, transposed
  ChunkGrads(int64_t C, int64_t K, int64_t V)
      : outer(2 * C * V), dq_gamma_w(2 * C * K), dscores(2 * C * C), dleft(2 * C * K), dT_beta(C * C),
        dT(C * C), tmp(C * C), dA(C * C), dk_hat(C * K), dk_gamma(C * K), dv(C * V), dk_over(C * K), dG(C * K),
        d_decay(K), d_first(K), d_last(K), dbeta(C), dots(C), k_hat_t(K * C), minus_du_t(V * C), state(K * V),
        b_t(std::max({K, V, C}) * C) {}

  float* d_o() { return outer.data(); }
  float* minus_du() { return outer.data() + outer.size() / 2; }
  float* dq_gamma() { return dq_gamma_w.data(); }
  float* dw() { return dq_gamma_w.data() + dq_gamma_w.size() / 2; }
  float* dP() { return dscores.data(); }
  float* dSk() { return dscores.data() + dscores.size() / 2; }
  float* dleft_q() { return dleft.data(); }
  float* dleft_k() { return dleft.data() + dleft.size() / 2; }
};

// Gradients of one chunk, from the state at its start (transposed: S_t [V, K]), its pseudo values u
// [C, V], dS_t = dL/d(state after it), transposed [V, K] (updated in place to dL/dS, transposed) and d_o (in
// d): the recurrence's products as in state_backward plus o's P u, then the terms backwards to dq, dk, dv, dG
// (w.r.t. the cumulative log-decay) and dbeta, in d.
//
// dS is carried transposed because both of the chunk's products with dS^T (dK_hat, dGamma_C) then read it
// as it lies, where it was transposed every chunk ([128 x 128] at K3's shapes); -du's product with dS and
// dS's update are computed transposed instead, over operands of C rows (K_hat^T and -du^T, [128 x 16]).
// Every element is the same chain of FMAs as in the untransposed products: the same bits.
__attribute__((target("avx2,fma"))) void chunk_backward(ChunkTerms& t, ChunkGrads& d, const float* S_t,
                                                       const float* u, float* dS_t, const ChunkOptions& opt) {
  const int64_t C = t.C, K = t.K, V = t.V;
  // -du^T = -(d_o^T P + dS^T K_hat^T); dP = d_o u^T (lower triangle); [d(q Gamma); dW] = [d_o; -du] S^T;
  // dK_hat = u dS^T; dGamma_C = sum_V S * dS; then dS^T <- dS^T Gamma_C + [d_o; -du]^T [q Gamma; W]
  transpose(t.k_hat.data(), C, K, d.k_hat_t.data(), opt.wide);
  run({V, C, C, transposed(d.d_o(), V), t.P(), -1.0f, nullptr, nullptr, d.minus_du_t.data()}, opt.wide);
  run({V, C, K, plain(dS_t, K), d.k_hat_t.data(), -1.0f, d.minus_du_t.data(), nullptr, d.minus_du_t.data(),
       &t.ahead},
      opt.wide);
  transpose(d.minus_du_t.data(), V, C, d.minus_du(), opt.wide);
  product_with_transpose(d.d_o(), u, C, C, V, 1.0f, d.dP(), false, d.b_t.data(), opt.wide);
  run({2 * C, K, V, plain(d.outer.data(), V), S_t, 1.0f, nullptr, nullptr, d.dq_gamma_w.data(), &t.ahead},
      opt.wide);
  run({C, K, V, plain(u, V), dS_t, 1.0f, nullptr, nullptr, d.dk_hat.data(), &t.ahead}, opt.wide);
  column_dots(S_t, dS_t, V, K, d.d_decay.data());  // sum_V S * dS
  run({V, K, 2 * C, transposed(d.outer.data(), V), t.reading.data(), 1.0f, dS_t, nullptr, dS_t, &t.ahead,
       t.decay.data()},
      opt.wide);
  // W = T_beta k Gamma, U = T_beta v: dT_beta = dW (k Gamma)^T + dU v^T; d(k Gamma) = T_beta^T dW; dv = T_beta^T dU
  product_with_transpose(d.dw(), t.k_gamma.data(), C, C, K, 1.0f, d.dT_beta.data(), false, d.b_t.data(),
                         opt.wide);
  product_with_transpose(d.minus_du(), t.v.data(), C, C, V, -1.0f, d.dT_beta.data(), true, d.b_t.data(),
                         opt.wide);
  run({C, K, C, transposed(t.t_beta.data(), C), d.dw(), 1.0f, nullptr, nullptr, d.dk_gamma.data()}, opt.wide);
  run({C, V, C, transposed(t.t_beta.data(), C), d.minus_du(), -1.0f, nullptr, nullptr, d.dv.data()}, opt.wide);
  // T_beta = T diag(beta); T = (I + A)^-1 so dA = -T^T dT T^T (strict lower part); A = diag(beta) Sk
  std::fill(d.dbeta.begin(), d.dbeta.end(), 0.0f);
  for (int64_t i = 0; i < C; ++i) {
    for (int64_t j = 0; j < C; ++j) {
      d.dT[i * C + j] = d.dT_beta[i * C + j] * t.beta[j];
      d.dbeta[j] += d.dT_beta[i * C + j] * t.t_inv[i * C + j];
    }
  }
  run({C, C, C, transposed(t.t_inv.data(), C), d.dT.data(), 1.0f, nullptr, nullptr, d.tmp.data()}, opt.wide);
  product_with_transpose(d.tmp.data(), t.t_inv.data(), C, C, C, -1.0f, d.dA.data(), false, d.b_t.data(), opt.wide);
  for (int64_t i = 0; i < C; ++i) {
    for (int64_t j = 0; j < C; ++j) {
      const bool strict = j < i;
      d.dbeta[i] += strict ? d.dA[i * C + j] * t.Sk()[i * C + j] : 0.0f;
      d.dSk()[i * C + j] = strict ? t.beta[i] * d.dA[i * C + j] : 0.0f;
      if (j > i) d.dP()[i * C + j] = 0.0f;  // P is its lower triangle
    }
  }
  // [P; Sk] = [left_q; left_k] k_over^T: d left = [dP; dSk] k_over, dk_over = [dP; dSk]^T [left_q; left_k]
  run({2 * C, K, C, plain(d.dscores.data(), C), t.k_over.data(), 1.0f, nullptr, nullptr, d.dleft.data()}, opt.wide);
  run({C, K, 2 * C, transposed(d.dscores.data(), C), t.left.data(), 1.0f, nullptr, nullptr, d.dk_over.data()},
      opt.wide);
  // elementwise: K_hat = k_over last, q Gamma = left_q first, k Gamma = left_k first, left = x down,
  // k_over = k / down, down = exp(local), last = exp(local_last), first = exp(G_0), Gamma_C = exp(G_last)
  std::fill(d.d_first.begin(), d.d_first.end(), 0.0f);
  std::fill(d.d_last.begin(), d.d_last.end(), 0.0f);
  for (int64_t c = 0; c < C; ++c) {  // row c; the buffers are distinct (__restrict): the compiler vectorises
    const int64_t row = c * K;
    const float *__restrict dk_hat = d.dk_hat.data() + row, *__restrict dq_gamma = d.dq_gamma() + row;
    const float *__restrict dk_gamma = d.dk_gamma.data() + row, *__restrict dk_over_in = d.dk_over.data() + row;
    const float *__restrict k_over = t.k_over.data() + row, *__restrict left_q = t.left_q() + row;
    const float *__restrict left_k = t.left_k() + row, *__restrict down = t.down.data() + row;
    const float *__restrict q = t.q.data() + row, *__restrict k = t.k.data() + row;
    const float *__restrict last = t.last.data(), *__restrict first = t.first.data();
    float *__restrict d_last = d.d_last.data(), *__restrict d_first = d.d_first.data();
    float *__restrict dleft_q = d.dleft_q() + row, *__restrict dleft_k = d.dleft_k() + row;
    float* __restrict dG = d.dG.data() + row;
#pragma GCC ivdep
    for (int64_t j = 0; j < K; ++j) {
      d_last[j] += dk_hat[j] * k_over[j];
      d_first[j] += dq_gamma[j] * left_q[j] + dk_gamma[j] * left_k[j];
      const float dk_over = dk_over_in[j] + dk_hat[j] * last[j];
      const float dlq = dleft_q[j] + dq_gamma[j] * first[j];
      const float dlk = dleft_k[j] + dk_gamma[j] * first[j];
      const float d_down = dlq * q[j] + dlk * k[j];
      const float d_up = dk_over * k[j];
      dleft_q[j] = dlq * down[j];                     // now d(normalised q)
      dleft_k[j] = dlk * down[j] + dk_over / down[j];  // now d(normalised k)
      dG[j] = d_down * down[j] - d_up / down[j];       // d local, for now
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

}  // namespace
