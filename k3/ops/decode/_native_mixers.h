// The two token mixers of a decoder layer for one token per sequence, each in one call, from the layer's
// un-normalised input x [B, hidden] to its update [B, hidden] (k3/model/kda.py and k3/model/mla.py hold the
// general forms these must equal).
//
// KDA:  xn = rms(x) w_in;  q, k, v, f_a, b, gate(_a) = projections of xn (one parallel region)
//       f = f_b(f_a), gate = g_b(g_a) (low rank) or g_proj(xn);  q, k, v = silu(shortconv([tail; .]))
//       g = lb sigmoid(e^A (f + dt)) (bounded) or -e^A softplus(f + dt);  beta = sigmoid(b)
//       o, S' = delta-rule step of l2(q) scale, l2(k), v (k3/ops/kda/_native_decode.h), per head
//       update = o_proj(rms_head(o) w_o * sigmoid(gate))
// MLA (weight-absorbed):  xn = rms(x) w_in;  q = q_proj(xn) or q_b(rms(q_a(xn)));  c, k_r = kv_a(xn), c = rms(c)
//       (c, k_r) written at position lengths[b] of the cache; per head over positions <= lengths[b]:
//       p = softmax(((q_n W_k) c^T + q_r k_r^T) scale);  o = (p c) W_v^T (* sigmoid(g_proj xn));  o_proj(o)
#pragma once

#include "_native_gemv.h"
#include "_native_weighted.h"
#include "kda/_native_decode.h"

namespace decode_native {

constexpr int64_t kHeadGroup = 8;  // MLA heads of one sequence attending together (weighted_rows' limit)
constexpr int64_t kAttendTile = 128;  // cached positions a chunk's head groups go over together (K3: 288 KB)
constexpr int64_t kCacheFromMemory = int64_t{8} << 20;  // a sequence's cache larger than this: fewer chunks

// An MLA head's weights over its S positions, in place: p[t] = softmax_t((p[t] + rope_scores[t]) scale),
// 8 positions at a time, the exps by k3_math::exp8 (the last positions padded with -inf, whose exp is 0, so
// a weight's bits depend on its score, the head's largest score and their sum alone). A NaN score makes
// every weight NaN, as libm's scalar exp did. Against the scalar loop it replaced, switched at run time in
// one build: a `mini` MLA mixer at 512 / 4,096 positions 139-141 -> 123-125 us / 601-608 -> 479-481 us (one
// thread, weights hot, best of 300 calls in three alternated processes, EPYC Zen 3).
__attribute__((target("avx2,fma"))) inline void position_weights(float* p, const float* rope_scores, float scale,
                                                                 int64_t S) {
  const int64_t body = S - S % 8;
  const __m256i last = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(S - body)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));  // the tail's lanes
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY), sc = _mm256_set1_ps(scale);
  const auto tail = [&](const float* from) __attribute__((target("avx2,fma"))) {  // -inf past S
    return _mm256_blendv_ps(minus_inf, _mm256_maskload_ps(from, last), _mm256_castsi256_ps(last));
  };
  __m256 top = minus_inf;  // max(v, top) keeps top where v is NaN
  for (int64_t t = 0; t < body; t += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(p + t), _mm256_loadu_ps(rope_scores + t)), sc);
    _mm256_storeu_ps(p + t, v);
    top = _mm256_max_ps(v, top);
  }
  if (body < S) {
    const __m256 v = _mm256_mul_ps(_mm256_add_ps(tail(p + body), tail(rope_scores + body)), sc);
    _mm256_maskstore_ps(p + body, last, v);
    top = _mm256_max_ps(v, top);
  }
  top = _mm256_max_ps(top, _mm256_permute2f128_ps(top, top, 1));  // the largest score in every lane
  top = _mm256_max_ps(top, _mm256_shuffle_ps(top, top, 0x4E));
  top = _mm256_max_ps(top, _mm256_shuffle_ps(top, top, 0xB1));
  const auto weight = [&](__m256 score) __attribute__((target("avx2,fma"))) {
    const __m256 d = _mm256_sub_ps(score, top);
    return k3_math::keep_nan(d, k3_math::exp8(d));
  };
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < body; t += 8) {
    const __m256 e = weight(_mm256_loadu_ps(p + t));
    _mm256_storeu_ps(p + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (body < S) {
    const __m256 e = weight(tail(p + body));
    _mm256_maskstore_ps(p + body, last, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 total = _mm256_set1_ps(mxfp4_rows::horizontal_sum(sum));
  for (int64_t t = 0; t < body; t += 8) _mm256_storeu_ps(p + t, _mm256_div_ps(_mm256_loadu_ps(p + t), total));
  if (body < S) _mm256_maskstore_ps(p + body, last, _mm256_div_ps(tail(p + body), total));
}

// d[i] = e^g with g = lb sigmoid(rate d[i]) for i < K (KDA's bounded gate; d holds f + dt on entry), 8 channels
// at a time; NaN stays NaN. With libm's scalar exp, 8 heads of 64 took 3.61 us, 0.85 so (one thread, EPYC
// Zen 3); with the SiLUs and output gates also 8 at a time, a `mini` kda_mixer 231-232 -> 222-223 us (one
// build, the two switched at run time, best of 3,000 calls in each of three alternated processes).
__attribute__((target("avx2,fma"))) inline void bounded_decay(float* d, int64_t K, float lower_bound, float rate) {
  const __m256 lb = _mm256_set1_ps(lower_bound), a = _mm256_set1_ps(rate);
  k3_math::map8(d, K, [&](__m256 fi) __attribute__((target("avx2,fma"))) {
    const __m256 g = _mm256_mul_ps(lb, k3_math::sigmoid8(_mm256_mul_ps(a, fi)));
    return k3_math::keep_nan(g, k3_math::exp8(g));
  });
}

inline float inverse_l2(const float* x, int64_t n, float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.0f / std::sqrt(sum + eps);
}

// Returns {update [B, hidden], new tail_q, new tail_k, new tail_v, state}: the recurrent state is updated in
// place (a fresh [B, H, K, V] each step cost page faults: 50 MB a layer at K3's 96 heads and B = 8); the other
// inputs are not modified.
inline std::vector<Tensor> kda_mixer(const Tensor& x, const Tensor& norm_w, double norm_eps, const Tensor& w_q,
                                     const Tensor& w_k, const Tensor& w_v, const Tensor& conv_q,
                                     const Tensor& conv_k, const Tensor& conv_v, const Tensor& w_fa,
                                     const Tensor& w_fb, const Tensor& a_log, const Tensor& dt_bias,
                                     std::optional<double> lower_bound, const Tensor& w_b, const Tensor& w_gate,
                                     const Optional& w_gate_b, const Tensor& o_norm_w, double o_norm_eps,
                                     const Tensor& w_o, const Tensor& tail_q, const Tensor& tail_k,
                                     const Tensor& tail_v, const Tensor& state, double l2_eps, double scale) {
  TORCH_CHECK(state.dim() == 4, "state must be [B, heads, K, V]");
  const int64_t B = rows_of(x, "x"), D = x.size(-1);
  const int64_t H = state.size(1), K = state.size(2), V = state.size(3), P = H * K, Pv = H * V;
  const int64_t width = conv_q.size(-1) - 1, d = matrix_rows(w_fa);
  check_rows(x, B, D, "x");
  check_vector(norm_w, D, "the input norm's weight");
  check_rows(state, B * H * K, V, "state");
  check_rows(conv_q, P, width + 1, "conv_q");
  check_rows(conv_k, P, width + 1, "conv_k");
  check_rows(conv_v, Pv, width + 1, "conv_v");
  check_rows(tail_q, B * width, P, "tail_q");
  check_rows(tail_k, B * width, P, "tail_k");
  check_rows(tail_v, B * width, Pv, "tail_v");
  check_vector(dt_bias, P, "dt_bias");
  check_vector(o_norm_w, K, "o_norm's weight");
  TORCH_CHECK(a_log.scalar_type() == torch::kFloat32 && a_log.is_contiguous() && a_log.numel() >= H,
              "A_log must hold at least one float32 per head");
  TORCH_CHECK(K == V, "the KDA kernel needs head_dim K == V");
  const Weight q = dense_weight(w_q, D, "q_proj"), k = dense_weight(w_k, D, "k_proj");
  const Weight v = dense_weight(w_v, D, "v_proj"), fa = dense_weight(w_fa, D, "f_a_proj");
  const Weight fb = dense_weight(w_fb, d, "f_b_proj"), b = dense_weight(w_b, D, "b_proj");
  const Weight ga = dense_weight(w_gate, D, "g_proj / g_a_proj");
  const Weight o_proj = dense_weight(w_o, Pv, "o_proj");
  TORCH_CHECK(q.N == P && k.N == P && v.N == Pv && fb.N == P && b.N == H && o_proj.N == D,
              "projection shapes do not match the state's heads and head size");
  const float eps = static_cast<float>(norm_eps);

  Buffer xn(B * D);
  for (int64_t r = 0; r < B; ++r) rms_norm(x.data_ptr<float>() + r * D, norm_w.data_ptr<float>(), eps, D, xn.data() + r * D);
  Buffer yq(B * P), yk(B * P), yv(B * Pv), yfa(B * d);
  Buffer yb(B * H), yga(B * ga.N), f(B * P), gb_out;
  project(xn.data(), B, {{q, yq.data()}, {k, yk.data()}, {v, yv.data()},
                                    {fa, yfa.data()}, {b, yb.data()}, {ga, yga.data()}});
  std::optional<Weight> gb;  // a low-rank gate's g_b_proj
  const float* gate = yga.data();  // [B, heads * V]
  if (w_gate_b.has_value()) {
    gb = dense_weight(*w_gate_b, ga.N, "g_b_proj");
    TORCH_CHECK(gb->N == Pv, "g_b_proj must have heads * V rows");
    gb_out.resize(B * Pv);
    gate = gb_out.data();
  } else {
    TORCH_CHECK(ga.N == Pv, "g_proj must have heads * V rows");
  }

  Buffer cq(B * P), ck(B * P), cv(B * Pv), o(B * Pv);
  Tensor new_q = torch::empty_like(tail_q), new_k = torch::empty_like(tail_k), new_v = torch::empty_like(tail_v);
  const float* alog = a_log.data_ptr<float>();
  const float* dt = dt_bias.data_ptr<float>();
  const float l2 = static_cast<float>(l2_eps), s = static_cast<float>(scale), oeps = static_cast<float>(o_norm_eps);
  // Heads in chunks, taken as threads go, each for every row: its rows of f_b (and g_b), its channels' short
  // convolutions, then its delta-rule step. The low-rank products and the convolutions were phases of their
  // own, the convolutions serial (22 us of a `mini` KDA layer's 250 at 2 threads, Zen 3: the second thread
  // waited while one core read the tails and conv weights from memory); `mini`'s steps 6.32 / 7.25 -> 6.29 /
  // 7.11 ms (medians of 1,200 steps alternated step by step with the old order, two processes).
  k3_native::parallel_chunks(H, 2, 2, [&](int64_t h0, int64_t h1) {
    fb.rows(yfa.data(), B, f.data(), P, h0 * K, h1 * K);
    if (gb.has_value()) gb->rows(yga.data(), B, gb_out.data(), Pv, h0 * V, h1 * V);
    const int64_t cqk = h0 * K, nqk = (h1 - h0) * K, cvv = h0 * V, nv = (h1 - h0) * V;
    for (int64_t r = 0; r < B; ++r) {
      kda_decode::short_conv(yq.data() + r * P + cqk, tail_q.data_ptr<float>() + r * width * P + cqk,
                             conv_q.data_ptr<float>() + cqk * (width + 1), width, nqk, P, cq.data() + r * P + cqk,
                             new_q.data_ptr<float>() + r * width * P + cqk);
      kda_decode::short_conv(yk.data() + r * P + cqk, tail_k.data_ptr<float>() + r * width * P + cqk,
                             conv_k.data_ptr<float>() + cqk * (width + 1), width, nqk, P, ck.data() + r * P + cqk,
                             new_k.data_ptr<float>() + r * width * P + cqk);
      kda_decode::short_conv(yv.data() + r * Pv + cvv, tail_v.data_ptr<float>() + r * width * Pv + cvv,
                             conv_v.data_ptr<float>() + cvv * (width + 1), width, nv, Pv, cv.data() + r * Pv + cvv,
                             new_v.data_ptr<float>() + r * width * Pv + cvv);
    }
    std::vector<float> qn(K), kn(K), decay(K), kS(V), oh(V);
    for (int64_t r = 0; r < B; ++r)
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t z = r * H + h;
        const float* cqz = cq.data() + r * P + h * K;
        const float* ckz = ck.data() + r * P + h * K;
        const float nq = inverse_l2(cqz, K, l2), nk = inverse_l2(ckz, K, l2);
        const float rate = std::exp(alog[h]);
        for (int64_t i = 0; i < K; ++i) {
          qn[i] = cqz[i] * nq * s;
          kn[i] = ckz[i] * nk;
          decay[i] = f.data()[r * P + h * K + i] + dt[h * K + i];  // f + dt, then e^g of it
        }
        if (lower_bound.has_value()) {
          bounded_decay(decay.data(), K, static_cast<float>(*lower_bound), rate);
        } else {
          for (int64_t i = 0; i < K; ++i) decay[i] = std::exp(-rate * softplus(decay[i]));
        }
        const float beta = sigmoid(yb.data()[r * H + h]);
        kda_decode::delta_step(qn.data(), kn.data(), cv.data() + r * Pv + h * V, decay.data(), beta,
                               state.data_ptr<float>() + z * K * V, K, V, oh.data(),
                               state.data_ptr<float>() + z * K * V, kS.data());  // in place: S is read first
        float* out = o.data() + r * Pv + h * V;
        rms_norm(oh.data(), o_norm_w.data_ptr<float>(), oeps, V, out);
        const float* gz = gate + r * Pv + h * V;
        gate_by_sigmoid(out, gz, V);
      }
  });
  Tensor update = rows_like(x, D);
  project(o.data(), B, {{o_proj, update.data_ptr<float>()}});
  return {update, new_q, new_k, new_v, state};
}

// Writes row b's latent and k_rope at position lengths[b] of the cache buffers (which must have room) and
// returns {the update [B, hidden], lengths + 1} (lengths itself is not modified).
inline std::vector<Tensor> mla_mixer(const Tensor& x, const Tensor& norm_w, double norm_eps, const Tensor& w_q,
                        const Optional& q_norm_w, const Optional& w_q_b, double latent_eps, const Tensor& w_kv_a,
                        const Tensor& kv_norm_w, const Tensor& w_kv_b, const Optional& w_g, const Tensor& w_o,
                        const Tensor& latent, const Tensor& k_rope, const Tensor& lengths, int64_t heads,
                        int64_t nope, int64_t rope, int64_t v_dim, double scale) {
  TORCH_CHECK(latent.dim() == 3 && k_rope.dim() == 3, "the cache must be [B, capacity, .]");
  const int64_t B = rows_of(x, "x"), D = x.size(-1), cap = latent.size(1), L = latent.size(2), dq = nope + rope;
  check_rows(x, B, D, "x");
  check_vector(norm_w, D, "the input norm's weight");
  check_vector(kv_norm_w, L, "kv_a_layernorm's weight");
  check_rows(latent, B * cap, L, "the latent cache");
  check_rows(k_rope, B * cap, rope, "the k_rope cache");
  TORCH_CHECK(lengths.scalar_type() == torch::kInt64 && lengths.is_contiguous() && lengths.numel() == B,
              "lengths must be [B] int64");
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < B; ++r) TORCH_CHECK(0 <= len[r] && len[r] < cap, "the cache has no room at position ", len[r]);
  const Weight q = dense_weight(w_q, D, "q_proj / q_a_proj"), kv_a = dense_weight(w_kv_a, D, "kv_a_proj_with_mqa");
  const Weight kv_b = dense_weight(w_kv_b, L, "kv_b_proj"), o_proj = dense_weight(w_o, heads * v_dim, "o_proj");
  TORCH_CHECK(kv_a.N == L + rope && kv_b.N == heads * (nope + v_dim) && o_proj.N == D, "MLA projection shapes");
  TORCH_CHECK(!kv_b.tiled && !kv_b.paired, "kv_b_proj is read head by head in place: it must stay row-major");
  const float eps = static_cast<float>(norm_eps), leps = static_cast<float>(latent_eps);

  Buffer xn(B * D);
  for (int64_t r = 0; r < B; ++r) rms_norm(x.data_ptr<float>() + r * D, norm_w.data_ptr<float>(), eps, D, xn.data() + r * D);
  Buffer yq(B * q.N), ykv(B * kv_a.N), yg;
  std::vector<Job> jobs = {{q, yq.data()}, {kv_a, ykv.data()}};
  if (w_g.has_value()) {
    const Weight g = dense_weight(*w_g, D, "g_proj");
    TORCH_CHECK(g.N == heads * v_dim, "g_proj must have heads * v_dim rows");
    yg.resize(B * g.N);
    jobs.push_back({g, yg.data()});
  }
  project(xn.data(), B, jobs);
  if (w_q_b.has_value()) {  // low-rank queries: q_b(rms(q_a(xn)))
    TORCH_CHECK(q_norm_w.has_value(), "q_a_layernorm's weight is needed with q_b_proj");
    check_vector(*q_norm_w, q.N, "q_a_layernorm's weight");
    const Weight qb = dense_weight(*w_q_b, q.N, "q_b_proj");
    for (int64_t r = 0; r < B; ++r) rms_norm(yq.data() + r * q.N, q_norm_w->data_ptr<float>(), leps, q.N, yq.data() + r * q.N);
    Buffer full(B * qb.N);
    project(yq.data(), B, {{qb, full.data()}});
    yq.swap(full);
  }
  TORCH_CHECK(static_cast<int64_t>(yq.size()) == B * heads * dq, "the queries must have heads * (nope + rope) values");
  for (int64_t r = 0; r < B; ++r) {
    const float* kv = ykv.data() + r * kv_a.N;
    rms_norm(kv, kv_norm_w.data_ptr<float>(), leps, L, latent.data_ptr<float>() + (r * cap + len[r]) * L);
    std::copy(kv + L, kv + L + rope, k_rope.data_ptr<float>() + (r * cap + len[r]) * rope);
  }
  Buffer o(B * heads * v_dim);
  const float sc = static_cast<float>(scale);
  // kv_b's rows are read in place (absorbed into the query and the output), fp32 or BF16 alike. A thread
  // takes the heads of a chunk, one sequence at a time: their scores are products of the cached rows with up
  // to kHeadGroup queries at a time, and weighted_rows adds the rows up for up to kHeadGroup heads at once,
  // in registers. Both go over the cache a tile of kAttendTile positions at a time, every group of the chunk
  // on a tile before the next tile, so the cache crosses memory twice a chunk rather than twice a group (K3's
  // 96 heads: 12 groups, 24 passes over 75 MB of cache a layer at 32k positions). Every value is summed in
  // the order one head alone sums it (dense_rows' rows depend on neither their batch nor their range,
  // weighted_rows does axpy's arithmetic over the positions in order, tile after tile), so the bits are those
  // of one head at a time over the whole cache.
  const auto attend = [&](const auto* w_kv_b, int64_t z0, int64_t z1) {
    Buffer q_latent, q_rope, o_latent, p, rope_scores;
    const bool by_row = read_short_rows_one_by_one();  // short cached rows read once for a group's queries
    for (int64_t z = z0; z < z1;) {
      const int64_t r = z / heads, h0 = z % heads, n = std::min(z1 - z, heads - h0), S = len[r] + 1;
      const float* c = latent.data_ptr<float>() + r * cap * L;
      const float* kr = k_rope.data_ptr<float>() + r * cap * rope;
      q_latent.assign(n * L, 0.0f);
      q_rope.resize(n * rope);
      for (int64_t j = 0; j < n; ++j) {
        const float* qz = yq.data() + r * heads * dq + (h0 + j) * dq;  // [nope | rope]
        const auto* wk = w_kv_b + (h0 + j) * (nope + v_dim) * L;        // W_k [nope, L], then W_v [v_dim, L]
        for (int64_t i = 0; i < nope; ++i) axpy(qz[i], wk + i * L, L, q_latent.data() + j * L);
        std::copy_n(qz + nope, rope, q_rope.data() + j * rope);
      }
      p.resize(n * S);
      rope_scores.resize(n * S);
      const int64_t tile = n > kHeadGroup ? kAttendTile : S;  // one group: nothing to share a tile with
      // f(t0, t1, g, G): positions [t0, t1) for the heads [g, g + G) of the chunk, every group on a tile first
      const auto tiles_then_groups = [&](const auto& f) {
        for (int64_t t0 = 0; t0 < S; t0 += tile)
          for (int64_t g = 0; g < n; g += kHeadGroup) f(t0, std::min(S, t0 + tile), g, std::min(kHeadGroup, n - g));
      };
      tiles_then_groups([&](int64_t t0, int64_t t1, int64_t g, int64_t G) {
        float *pg = p.data() + g * S, *rg = rope_scores.data() + g * S;
        dense_rows(c, L, q_latent.data() + g * L, G, pg, S, t0, t1, kv_b.wide, by_row);         // (q_n W_k) . c_t
        dense_rows(kr, rope, q_rope.data() + g * rope, G, rg, S, t0, t1, kv_b.wide, by_row);  // q_r . k_r,t
      });
      for (int64_t j = 0; j < n; ++j) position_weights(p.data() + j * S, rope_scores.data() + j * S, sc, S);
      o_latent.assign(n * L, 0.0f);
      tiles_then_groups([&](int64_t t0, int64_t t1, int64_t g, int64_t G) {  // o_latent[j] = sum_t p[j, t] c_t
        weighted_rows(p.data() + g * S, S, G, c, L, o_latent.data() + g * L, kv_b.wide, t0, t1);
      });
      for (int64_t j = 0; j < n; ++j) {
        float* oz = o.data() + r * heads * v_dim + (h0 + j) * v_dim;
        const auto* wv = w_kv_b + (h0 + j) * (nope + v_dim) * L + nope * L;
        dense_rows(wv, L, o_latent.data() + j * L, 1, oz, v_dim, 0, v_dim);
        if (w_g.has_value()) {
          const float* gz = yg.data() + r * heads * v_dim + (h0 + j) * v_dim;
          gate_by_sigmoid(oz, gz, v_dim);
        }
      }
      z += n;
    }
  };
  // Heads in chunks taken as threads go: whole groups, unless too few heads would leave a thread idle. Where a
  // sequence's cache is larger than kCacheFromMemory (it then crosses memory each time it is read), about two
  // chunks a thread, as each chunk reads it twice; smaller caches stay in the caches and keep up to four.
  const int64_t threads = at::get_num_threads();
  const int64_t group_grain = std::clamp<int64_t>(B * heads / threads, 1, kHeadGroup);
  const int64_t most_positions = *std::max_element(len, len + B) + 1;
  const bool from_memory = most_positions * (L + rope) * int64_t(sizeof(float)) > kCacheFromMemory;
  const int64_t least = from_memory ? std::max<int64_t>(group_grain, B * heads / (2 * threads)) : group_grain;
  k3_native::parallel_chunks(B * heads, group_grain, least, [&](int64_t z0, int64_t z1) {
    kv_b.dense != nullptr ? attend(kv_b.dense, z0, z1) : attend(kv_b.bf16, z0, z1);
  });
  Tensor update = rows_like(x, D);
  project(o.data(), B, {{o_proj, update.data_ptr<float>()}});
  return {update, lengths + 1};
}

}  // namespace decode_native
