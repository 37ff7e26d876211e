// Fused one-token decode kernels: each piece of a decoder layer in one call, for B sequences of one token
// (k3/model/fused.py calls them; the model's general path is the reference they are tested against).
//
//   kda_mixer, mla_mixer      the token mixers, input norm included (_native_mixers.h)
//   mlp                       a dense gated MLP, its input norm optional (the first layer, shared experts)
//   moe_route                 the FFN norm, the router (sigmoid scores, biased grouped top-k, renormalised
//                             weights) and the latent down-projection
//   moe_experts               the chosen experts (fp32 or MXFP4; each distinct expert once for the rows that
//                             chose it; MXFP4 at one row in AVX-512 where the CPU has it, the same bits as
//                             AVX2), their weighted sum, latent norm, up-projection and shared experts
//   attn_res_read             an AttnRes read over the stream's values
//   project                   x [B, K] times several matrices, normalised first if asked (the final norm and lm_head)
//   decoder_layers            a step from its tokens' embedding rows to the output read in one call, running the
//                             kernels above (_native_step.h)
//   experts_rows              experts over blocks of rows (a many-token dispatch: MoE.experts_over_rows)
//   expert_rows               x [B, K] times one MXFP4 matrix, as moe_experts multiplies each, x exact or
//                             rounded to int8 (tests, benchmarks)
//   gated_activation          the MLPs' and experts' act(gate, up), as they apply it, fp32 or bf16, over
//                             any number of rows (a prefill's activations: k3.model.activations; tests)
//   tile_rows                 a BF16 matrix re-laid for the one-vector kernels (k3.model.tiling; _native_layout.h)
//   pair_rows                 a BF16 matrix re-laid for bf16 products (k3.model.tiling; _native_paired.h)
//   bf16_products_supported   whether this CPU has them (AVX-512 BF16)
//   short_rows_one_by_one     whether short fp32 rows are read one at a time (Zen 3, _native_gemv.h)
//   tiled_rows_ask_ahead      whether tiled BF16 rows at one vector ask for their lines ahead (not on Zen 4)
//   rows_from_blocks          rows of a tiled or paired matrix back in rows, for a prefill's GEMM (_native_layout.h)
//   on_huge_pages             copies of matrices packed together on huge pages (k3.model.tiling)
//
// A row input arrives as [B, hidden] or as the model's [B, 1, hidden] (no reshape on the Python side: a decode
// step of `mini` dispatched ~100 views); outputs keep its leading dims.
// Matrices are multiplied by at most a few vectors here: every group of matrices reading the same input
// is one parallel region over their rows (_native_gemv.h), so the work splits across threads.

#include <torch/extension.h>

#include "_native_common.h"
#include "_native_gemv.h"
#include "_native_weighted.h"
#include "_native_layout.h"
#include "_native_mixers.h"

namespace decode_native {

// A gated MLP's gate and up [m, D] and down [D, m], checked.
struct GatedWeights {
  Weight gate, up, down;

  GatedWeights(const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down, int64_t D)
      : gate(dense_weight(w_gate, D, "gate_proj")), up(dense_weight(w_up, D, "up_proj")),
        down(dense_weight(w_down, gate.N, "down_proj")) {
    TORCH_CHECK(up.N == gate.N && down.N == D, "MLP shapes");
  }
};

// down(act(gate(xn), up(xn))) with xn = x, or rms(x) w when a norm weight is given: [B, D] -> [B, D]
Tensor mlp(const Tensor& x, const Optional& norm_w, double norm_eps, const Tensor& w_gate, const Tensor& w_up,
           const Tensor& w_down, int64_t act, double beta, double linear_beta) {
  const int64_t B = rows_of(x, "x"), D = x.size(-1);
  check_rows(x, B, D, "x");
  const k3_math::GatedActivation f = activation(act, beta, linear_beta);
  const auto [gate, up, down] = GatedWeights(w_gate, w_up, w_down, D);
  const float* xn = x.data_ptr<float>();
  Buffer normed;
  if (norm_w.has_value()) {
    check_vector(*norm_w, D, "the norm's weight");
    normed.resize(B * D);
    for (int64_t r = 0; r < B; ++r)
      rms_norm(xn + r * D, norm_w->data_ptr<float>(), static_cast<float>(norm_eps), D, normed.data() + r * D);
    xn = normed.data();
  }
  Buffer g(B * gate.N), u(B * up.N);
  Tensor out = rows_like(x, D);
  project(xn, B, {{gate, g.data()}, {up, u.data()}});
  float* gp = g.data();
  const float* upp = u.data();
  f.apply(gp, upp, B * gate.N);
  project(gp, B, {{down, out.data_ptr<float>()}});
  return out;
}

// The k largest of values[0..n) (descending; ties to the lower index), as torch.topk picks them.
std::vector<int64_t> top_k(const float* values, int64_t n, int64_t k) {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return values[a] > values[b] || (values[a] == values[b] && a < b); });
  order.resize(k);
  return order;
}

// Returns {xn [B, D], z [B, L] (xn without a down-projection), weights [B, k], indices [B, k] int64}.
std::vector<Tensor> moe_route(const Tensor& x, const Tensor& norm_w, double norm_eps, const Tensor& w_router,
                              const Tensor& bias, int64_t groups, int64_t topk_groups, int64_t k, bool renormalize,
                              double scaling, const Optional& w_down) {
  const int64_t B = rows_of(x, "x"), D = x.size(-1);
  check_rows(x, B, D, "x");
  check_vector(norm_w, D, "the norm's weight");
  const Weight router = dense_weight(w_router, D, "the router's weight");
  const int64_t E = router.N;
  check_vector(bias, E, "e_score_correction_bias");
  TORCH_CHECK(groups >= 1 && E % groups == 0 && 1 <= topk_groups && topk_groups <= groups && 1 <= k &&
                  k <= E / groups * topk_groups,
              "router: bad groups / top-k");
  Tensor xn = rows_like(x, D);
  Buffer scores_(B * E);
  for (int64_t r = 0; r < B; ++r)
    rms_norm(x.data_ptr<float>() + r * D, norm_w.data_ptr<float>(), static_cast<float>(norm_eps), D, xn.data_ptr<float>() + r * D);
  std::vector<Job> jobs = {{router, scores_.data()}};
  Tensor z = xn;
  if (w_down.has_value()) {
    const Weight down = dense_weight(*w_down, D, "routed_expert_down_proj");
    z = rows_like(x, down.N);
    jobs.push_back({down, z.data_ptr<float>()});
  }
  project(xn.data_ptr<float>(), B, jobs);
  Tensor weights = torch::empty({B, k}, x.options()), indices = torch::empty({B, k}, x.options().dtype(torch::kInt64));
  const int64_t per_group = E / groups;
  std::vector<float> choice(E), group_score(groups);
  const float* correction = bias.data_ptr<float>();  // hoisted: data_ptr checks its dtype each call (~10 ns)
  for (int64_t r = 0; r < B; ++r) {
    float* s = scores_.data() + r * E;
    for (int64_t e = 0; e < E; ++e) choice[e] = (s[e] = sigmoid(s[e])) + correction[e];
    if (groups > 1) {  // keep the best topk_groups groups, ranked by the sum of their top-2 choice scores
      for (int64_t gi = 0; gi < groups; ++gi) {
        const auto best = top_k(choice.data() + gi * per_group, per_group, 2);
        group_score[gi] = choice[gi * per_group + best[0]] + choice[gi * per_group + best[1]];
      }
      std::vector<bool> keep(groups, false);
      for (int64_t gi : top_k(group_score.data(), groups, topk_groups)) keep[gi] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / per_group]) choice[e] = -INFINITY;
    }
    const auto chosen = top_k(choice.data(), E, k);
    float* w = weights.data_ptr<float>() + r * k;
    float total = 0.0f;
    for (int64_t j = 0; j < k; ++j) total += (w[j] = s[chosen[j]]);
    for (int64_t j = 0; j < k; ++j) {
      if (renormalize) w[j] = w[j] / (total + 1e-20f);
      w[j] *= static_cast<float>(scaling);
      indices.data_ptr<int64_t>()[r * k + j] = chosen[j];
    }
  }
  return {xn, z, weights, indices};
}

// The matrices of U experts ((w1, w3, w2) each: w1, w3 [m, L] and w2 [L, m]; `dense` fp32 / BF16, or `packed` +
// `scale` MXFP4, exact or with `int8_x`) as the kernels take them.
std::vector<Weight> expert_weights(int64_t L, const std::vector<Tensor>& dense, const std::vector<Tensor>& packed,
                                   const std::vector<Tensor>& scale, const std::string& variant, bool int8_x) {
  const bool is_packed = dense.empty(), wide = mxfp4_rows512::wide_variant(variant);
  const int64_t U = static_cast<int64_t>(is_packed ? packed.size() : dense.size()) / 3;
  TORCH_CHECK(U >= 1 && (is_packed ? packed.size() == 3 * U && scale.size() == packed.size() : dense.size() == 3 * U),
              "experts: (w1, w3, w2) of each distinct expert, fp32 in `dense` or MXFP4 in `packed` + `scale`");
  std::vector<Weight> w(3 * U);
  for (int64_t i = 0; i < 3 * U; ++i) {
    const int64_t K = i % 3 == 2 ? (is_packed ? packed[i - 2].size(0) : matrix_rows(dense[i - 2])) : L;
    w[i] = is_packed ? packed_weight(packed[i], scale[i], K, "an expert's matrix") : dense_weight(dense[i], K, "an expert's matrix");
    w[i].wide = wide;
    w[i].int8_x = int8_x && is_packed;
    TORCH_CHECK(w[i].N == (i % 3 == 2 ? L : w[i - i % 3].N), "expert ", i / 3, ": w1/w3 must be [m, L], w2 [L, m]");
  }
  return w;
}

// out [M, L] = w2(act(w1 rows, w3 rows)) for M rows [M, L] of one expert (w: its three matrices), on the calling
// thread; each row's value does not depend on the others (the kernels' rows are independent).
inline void expert_over_rows(const Weight* w, const k3_math::GatedActivation& f, const float* rows, int64_t M,
                             float* out) {
  const int64_t m = w[0].N, L = w[2].N;
  std::vector<float> gate(M * m), up(M * m);
  w[0].rows(rows, M, gate.data(), m, 0, m);
  w[1].rows(rows, M, up.data(), m, 0, m);
  f.apply(gate.data(), up.data(), M * m);
  w[2].rows(gate.data(), M, out, L, 0, L);
}

// Expert u's output for each of its counts[u] rows, the experts' rows consecutive in `rows` [R, L] (expert-major,
// as MoE.dispatch sorts its pairs): [R, L] in the same order. The threads take the experts in chunks as they go
// (a prefill's experts have very different numbers of rows).
Tensor experts_rows(const Tensor& rows, const std::vector<int64_t>& counts, const std::vector<Tensor>& dense,
                    const std::vector<Tensor>& packed, const std::vector<Tensor>& scale, int64_t act, double beta,
                    double linear_beta, const std::string& variant, bool int8_x) {
  const int64_t R = rows_of(rows, "rows"), L = rows.size(-1), U = static_cast<int64_t>(counts.size());
  check_rows(rows, R, L, "rows");
  const std::vector<Weight> w = expert_weights(L, dense, packed, scale, variant, int8_x);
  TORCH_CHECK(static_cast<int64_t>(w.size()) == 3 * U, "counts: one per expert given");
  std::vector<int64_t> start(U + 1, 0);
  for (int64_t u = 0; u < U; ++u) {
    TORCH_CHECK(counts[u] >= 0, "counts must not be negative");
    start[u + 1] = start[u] + counts[u];
  }
  TORCH_CHECK(start[U] == R, "counts must add up to the rows given");
  const k3_math::GatedActivation f = activation(act, beta, linear_beta);
  Tensor out = torch::empty_like(rows);
  const float* in = rows.data_ptr<float>();
  float* o = out.data_ptr<float>();
  k3_native::parallel_chunks(U, 1, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u)
      if (counts[u] > 0) expert_over_rows(&w[3 * u], f, in + start[u] * L, counts[u], o + start[u] * L);
  });
  return out;
}

// Row r's routed mixture sum_j weights[r, j] expert_{slots[r, j]}(z[r]) over the distinct experts given
// (w1, w3 [m, L] and w2 [L, m] each: `dense` fp32, or `packed` + `scale` MXFP4), then the latent norm and
// up-projection when given, plus the shared experts' MLP of xn when given: [B, D]. `int8_x`: MXFP4 experts
// multiply their inputs rounded to int8 per block (_native_int8.h; approximate), else exactly.
Tensor moe_experts(const Tensor& xn, const Tensor& z, const Tensor& weights, const std::vector<int64_t>& slots,
                   const std::vector<Tensor>& dense, const std::vector<Tensor>& packed,
                   const std::vector<Tensor>& scale, int64_t act, double beta, double linear_beta,
                   const Optional& latent_norm_w, double latent_eps, const Optional& w_up,
                   const Optional& shared_gate, const Optional& shared_up, const Optional& shared_down,
                   const std::string& variant, bool int8_x) {
  const int64_t B = rows_of(z, "z"), L = z.size(-1), k = weights.size(1);
  check_rows(z, B, L, "z");
  check_rows(weights, B, k, "weights");
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == B * k, "slots must hold B * k expert positions");
  const std::vector<Weight> w = expert_weights(L, dense, packed, scale, variant, int8_x);
  const int64_t U = static_cast<int64_t>(w.size()) / 3;
  const int64_t* slot = slots.data();
  std::vector<std::vector<int64_t>> pairs(U);  // per distinct expert, the pairs r * k + j that chose it
  for (int64_t i = 0; i < B * k; ++i) {
    TORCH_CHECK(0 <= slot[i] && slot[i] < U, "slots must index the experts given");
    pairs[slot[i]].push_back(i);
  }
  const k3_math::GatedActivation f = activation(act, beta, linear_beta);
  const bool shared = shared_gate.has_value();
  TORCH_CHECK(!shared || (shared_up.has_value() && shared_down.has_value()), "the shared experts need gate, up and down");
  const int64_t D = xn.size(-1);
  if (shared) check_rows(xn, B, D, "xn");
  // The shared experts' MLP of xn, as mlp() computes it: gate and up, act, down.
  const std::optional<GatedWeights> s_w =
      shared ? std::optional<GatedWeights>(std::in_place, *shared_gate, *shared_up, *shared_down, D) : std::nullopt;
  const int64_t s_m = shared ? s_w->gate.N : 0;
  Buffer s_g(B * s_m), s_u(B * s_m);
  const std::vector<Job> s_in = shared ? std::vector<Job>{{s_w->gate, s_g.data()}, {s_w->up, s_u.data()}}
                                       : std::vector<Job>{};
  // One region for the routed experts (arithmetic: exact MXFP4 decodes far slower than memory streams) and the
  // shared gate and up rows (a stream from memory), each expert followed by its share of the row pieces, so that
  // while one core computes an expert the other streams rows; then one for the up-projection and the shared
  // down rows. Against four regions (experts, shared gate and up, up-projection, shared down), Zen 3, 2 threads,
  // the two alternated in one process: `k3-slice`'s MoE (16 MXFP4 experts, 2 shared BF16) 35.1 -> 32.5 ms,
  // medians of 6 blocks; `mini`'s steps 8.22 / 7.01 -> 8.19 / 6.92 ms, medians of 800 steps alternated step by
  // step (both engines' cores are busy with the experts' arithmetic, so only the stream's pace is gained).
  const int64_t s_rows = rows_of_jobs(s_in), s_piece = shared ? project_grain(s_in) : 1;
  const int64_t R = (s_rows + s_piece - 1) / s_piece;
  std::vector<int64_t> tasks;  // expert u as -1 - u, each followed by its share of the row pieces (p >= 0)
  for (int64_t u = 0; u < U; ++u) {
    tasks.push_back(-1 - u);
    for (int64_t p = u * R / U; p < (u + 1) * R / U; ++p) tasks.push_back(p);
  }
  std::vector<float> per_pair(B * k * L);
  const float* zp = z.data_ptr<float>();
  const auto expert = [&](int64_t u) {
    const int64_t M = static_cast<int64_t>(pairs[u].size());
    if (M == 0) return;
    std::vector<float> rows(M * L), down(M * L);
    for (int64_t i = 0; i < M; ++i) std::copy_n(zp + pairs[u][i] / k * L, L, rows.data() + i * L);
    expert_over_rows(&w[3 * u], f, rows.data(), M, down.data());
    for (int64_t i = 0; i < M; ++i) std::copy_n(down.data() + i * L, L, per_pair.data() + pairs[u][i] * L);
  };
  const auto shared_rows = [&](int64_t piece) {
    project_rows(xn.data_ptr<float>(), B, s_in, piece * s_piece, std::min(s_rows, (piece + 1) * s_piece));
  };
  k3_native::parallel_tasks(U + R, [&](int64_t t) { tasks[t] < 0 ? expert(-1 - tasks[t]) : shared_rows(tasks[t]); });
  Tensor mixed = torch::zeros(z.sizes(), z.options());
  for (int64_t r = 0; r < B; ++r)
    for (int64_t j = 0; j < k; ++j)
      axpy(weights.data_ptr<float>()[r * k + j], per_pair.data() + (r * k + j) * L, L, mixed.data_ptr<float>() + r * L);
  if (latent_norm_w.has_value()) {
    check_vector(*latent_norm_w, L, "routed_expert_norm's weight");
    float* mp = mixed.data_ptr<float>();
    for (int64_t r = 0; r < B; ++r) rms_norm(mp + r * L, latent_norm_w->data_ptr<float>(), static_cast<float>(latent_eps), L, mp + r * L);
  }
  // One region again for the latent up-projection and the shared experts' down rows.
  std::vector<Job> last;
  Tensor out = mixed;  // this call's own tensor either way: the shared experts' rows are added into it
  Buffer shared_out;
  if (w_up.has_value()) {
    const Weight up = dense_weight(*w_up, L, "routed_expert_up_proj");
    out = rows_like(z, up.N);
    last.push_back({up, out.data_ptr<float>(), mixed.data_ptr<float>()});
  }
  if (shared) {
    TORCH_CHECK(out.numel() == B * D, "the shared experts' output must have the routed experts' width");
    f.apply(s_g.data(), s_u.data(), B * s_m);
    shared_out.resize(B * D);
    last.push_back({s_w->down, shared_out.data(), s_g.data()});
  }
  if (!last.empty()) project(nullptr, B, last);
  if (shared) axpy(1.0f, shared_out.data(), B * D, out.data_ptr<float>());  // 1 x + y: torch's add, bit for bit
  return out;
}

// sum_i p_i v_i over values [B, D] each, p = softmax_i(<v_i, w> / sqrt(mean(v_i^2) + eps)), w = norm_w * proj_w
// (k3.model.attn_res.attn_res_read).
Tensor attn_res_read(const std::vector<Tensor>& values, const Tensor& norm_w, const Tensor& proj_w, double eps) {
  TORCH_CHECK(!values.empty(), "attn_res_read needs at least one value");
  const int64_t D = values[0].size(-1), B = rows_of(values[0], "an AttnRes value"), N = static_cast<int64_t>(values.size());
  for (const Tensor& v : values) check_rows(v, B, D, "an AttnRes value");
  check_vector(norm_w, D, "the AttnRes norm's weight");
  check_vector(proj_w, D, "the AttnRes projection's weight");
  // The pointers are taken once: data_ptr checks the dtype and storage on every call, and reading them per
  // element made this read of a few kB cost 12 us instead of 4.
  std::vector<const float*> rows(N);
  for (int64_t n = 0; n < N; ++n) rows[n] = values[n].data_ptr<float>();
  const float *norm = norm_w.data_ptr<float>(), *proj = proj_w.data_ptr<float>();
  std::vector<float> w(D), logits(N);
  for (int64_t i = 0; i < D; ++i) w[i] = norm[i] * proj[i];
  Tensor out = torch::zeros(values[0].sizes(), values[0].options());
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < B; ++r) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t n = 0; n < N; ++n) {
      const float* v = rows[n] + r * D;
      const float along = dot(v, w.data(), D), squares = dot(v, v, D);
      logits[n] = along / std::sqrt(squares / static_cast<float>(D) + static_cast<float>(eps));
      top = std::max(top, logits[n]);
    }
    for (int64_t n = 0; n < N; ++n) total += (logits[n] = std::exp(logits[n] - top));
    for (int64_t n = 0; n < N; ++n) axpy(logits[n] / total, rows[n] + r * D, D, o + r * D);
  }
  return out;
}

// x [B, K] (rms-normalised first when a norm weight is given) times each matrix [N_i, K] (fp32, BF16 or tiled
// BF16: dense_weight): [B, N_i] each.
std::vector<Tensor> project_all(const Tensor& x, const Optional& norm_w, double norm_eps,
                                const std::vector<Tensor>& matrices) {
  TORCH_CHECK(!matrices.empty(), "project needs at least one matrix");
  const int64_t B = rows_of(x, "x"), K = x.size(-1);
  check_rows(x, B, K, "x");
  Tensor xn = x;
  if (norm_w.has_value()) {
    check_vector(*norm_w, K, "the norm's weight");
    xn = rows_like(x, K);
    for (int64_t r = 0; r < B; ++r)
      rms_norm(x.data_ptr<float>() + r * K, norm_w->data_ptr<float>(), static_cast<float>(norm_eps), K, xn.data_ptr<float>() + r * K);
  }
  std::vector<Job> jobs;
  std::vector<Tensor> outs;
  for (const Tensor& m : matrices) {
    const Weight w = dense_weight(m, K, "a matrix");
    outs.push_back(rows_like(x, w.N));
    jobs.push_back({w, outs.back().data_ptr<float>()});
  }
  project(xn.data_ptr<float>(), B, jobs);
  return outs;
}

// x [B, K] times one dense fp32 or BF16 matrix w [N, K] (or tiled, or paired) as the decode step multiplies it (Weight::rows:
// the AVX-512 tiles where `variant` allows; short fp32 rows in the CPU's order, or as `short_rows` says:
// "tiles" or "one_by_one"; the same bits), rows split across threads: [B, N]. For tests and benchmarks.
Tensor dense_rows_product(const Tensor& x, const Tensor& w, const std::string& variant, const std::string& short_rows) {
  const int64_t B = rows_of(x, "x"), K = x.size(-1);
  check_rows(x, B, K, "x");
  TORCH_CHECK(short_rows == "auto" || short_rows == "tiles" || short_rows == "one_by_one",
              "short_rows must be 'auto', 'tiles' or 'one_by_one', got '", short_rows, "'");
  Weight weight = dense_weight(w, K, "the matrix");
  weight.wide = mxfp4_rows512::wide_variant(variant);
  if (short_rows != "auto") weight.short_rows_one_by_one = short_rows == "one_by_one";
  Tensor y = rows_like(x, weight.N);
  project(x.data_ptr<float>(), B, {{weight, y.data_ptr<float>()}});
  return y;
}

// sum_t a[j, t] c[t, :] for a [G, S] (G <= 8) and c [S, L], as MLA's decode step sums a group of heads'
// cached latents (weighted_rows: the AVX-512 blocks where `variant` allows, the same bits): [G, L].
// For tests.
Tensor weighted_rows_product(const Tensor& a, const Tensor& c, const std::string& variant) {
  const int64_t G = rows_of(a, "a"), S = a.size(-1), L = c.size(-1);
  check_rows(a, G, S, "a");
  check_rows(c, S, L, "c");
  TORCH_CHECK(1 <= G && G <= kHeadGroup, "a must have 1 to ", kHeadGroup, " rows, got ", G);
  Tensor o = torch::zeros({G, L}, a.options());
  weighted_rows(a.data_ptr<float>(), S, G, c.data_ptr<float>(), L, o.data_ptr<float>(),
                mxfp4_rows512::wide_variant(variant));
  return o;
}

// act(g, u) elementwise over g and u of one shape, fp32 or bfloat16 (computed in fp32; a bfloat16 result rounded
// once), as mlp and the experts apply it (GatedActivation::apply), split across threads in whole vectors of 8:
// a many-token forward's activations (k3.model.activations.fused_gated), and the tests of its accuracy and bits.
Tensor gated_activation(const Tensor& g, const Tensor& u, int64_t act, double beta, double linear_beta) {
  const auto dtype = g.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) && u.scalar_type() == dtype &&
                  g.sizes() == u.sizes() && g.device().is_cpu() && u.device().is_cpu(),
              "g and u must be CPU tensors of one shape, both fp32 or both bfloat16; got ", g.sizes(), " ",
              g.scalar_type(), " and ", u.sizes(), " ", u.scalar_type());
  const k3_math::GatedActivation f = activation(act, beta, linear_beta);
  Tensor out = g.contiguous().clone();
  const Tensor up = u.contiguous();
  constexpr int64_t kVector = 8, kGrain = 1 << 14;  // a thread's share in whole vectors; no split below 16k
  const int64_t n = out.numel();
  at::parallel_for(0, (n + kVector - 1) / kVector, kGrain / kVector, [&](int64_t v0, int64_t v1) {
    const int64_t i0 = v0 * kVector, count = std::min(n, v1 * kVector) - i0;
    if (dtype == torch::kFloat32)
      f.apply(out.data_ptr<float>() + i0, up.data_ptr<float>() + i0, count);
    else
      f.apply_bf16(reinterpret_cast<uint16_t*>(out.data_ptr()) + i0,
                   reinterpret_cast<const uint16_t*>(up.data_ptr()) + i0, count);
  });
  return out;
}

// x [B, K] times one MXFP4 matrix (packed [N, K/2], scale [N, K/32]) as the decode step multiplies a chosen
// expert's matrices (Weight::rows: batch-invariant bits; at B = 1 the AVX-512 kernel where `variant` allows),
// its rows split across threads by `project` (moe_experts gives each thread whole experts instead): [B, N].
// For tests and benchmarks/mxfp4.py.
Tensor expert_rows(const Tensor& x, const Tensor& packed, const Tensor& scale, const std::string& variant,
                   bool int8_x) {
  const int64_t B = rows_of(x, "x"), K = x.size(-1);
  check_rows(x, B, K, "x");
  Weight w = packed_weight(packed, scale, K, "the matrix");
  w.wide = mxfp4_rows512::wide_variant(variant);
  w.int8_x = int8_x;
  Tensor y = rows_like(x, w.N);
  project(x.data_ptr<float>(), B, {{w, y.data_ptr<float>()}});
  return y;
}

}  // namespace decode_native

#include "_native_step.h"  // decoder_layers: the loop over a step's layers, calling the kernels above

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace decode_native;
  namespace py = pybind11;
  m.doc() = "k3 fused one-token decode kernels: a decoder layer's mixer, FFN, router and experts per call";
  m.def("kda_mixer", &kda_mixer, "a KDA layer's update for one token per row, input norm included",
        py::arg("x"), py::arg("norm_w"), py::arg("norm_eps"), py::arg("w_q"), py::arg("w_k"), py::arg("w_v"),
        py::arg("conv_q"), py::arg("conv_k"), py::arg("conv_v"), py::arg("w_fa"), py::arg("w_fb"), py::arg("a_log"),
        py::arg("dt_bias"), py::arg("lower_bound"), py::arg("w_b"), py::arg("w_gate"), py::arg("w_gate_b"),
        py::arg("o_norm_w"), py::arg("o_norm_eps"), py::arg("w_o"), py::arg("tail_q"), py::arg("tail_k"),
        py::arg("tail_v"), py::arg("state"), py::arg("l2_eps"), py::arg("scale"));
  m.def("mla_mixer", &mla_mixer,
        "an MLA layer's update for one token per row (absorbed) and lengths + 1, writing its cache",
        py::arg("x"), py::arg("norm_w"), py::arg("norm_eps"), py::arg("w_q"), py::arg("q_norm_w"), py::arg("w_q_b"),
        py::arg("latent_eps"), py::arg("w_kv_a"), py::arg("kv_norm_w"), py::arg("w_kv_b"), py::arg("w_g"),
        py::arg("w_o"), py::arg("latent"), py::arg("k_rope"), py::arg("lengths"), py::arg("heads"), py::arg("nope"),
        py::arg("rope"), py::arg("v_dim"), py::arg("scale"));
  m.def("mlp", &mlp, "down(act(gate(xn), up(xn))), xn = rms(x) norm_w if given", py::arg("x"), py::arg("norm_w"),
        py::arg("norm_eps"), py::arg("w_gate"), py::arg("w_up"), py::arg("w_down"), py::arg("act"), py::arg("beta"),
        py::arg("linear_beta"));
  m.def("moe_route", &moe_route, "FFN norm, router and latent down-projection: (xn, z, weights, indices)",
        py::arg("x"), py::arg("norm_w"), py::arg("norm_eps"), py::arg("w_router"), py::arg("bias"), py::arg("groups"),
        py::arg("topk_groups"), py::arg("k"), py::arg("renormalize"), py::arg("scaling"), py::arg("w_down"));
  m.def("moe_experts", &moe_experts, "the chosen experts, their mixture, latent norm, up-projection, shared experts",
        py::arg("xn"), py::arg("z"), py::arg("weights"), py::arg("slots"), py::arg("dense"), py::arg("packed"),
        py::arg("scale"), py::arg("act"), py::arg("beta"), py::arg("linear_beta"), py::arg("latent_norm_w"),
        py::arg("latent_eps"), py::arg("w_up"), py::arg("shared_gate"), py::arg("shared_up"), py::arg("shared_down"),
        py::arg("variant") = "auto", py::arg("int8_x") = false);
  m.def("experts_rows", &experts_rows,
        "each expert's MLP over its block of rows (experts' rows consecutive, `counts` each): [R, L] in order",
        py::arg("rows"), py::arg("counts"), py::arg("dense"), py::arg("packed"), py::arg("scale"), py::arg("act"),
        py::arg("beta"), py::arg("linear_beta"), py::arg("variant") = "auto", py::arg("int8_x") = false);
  m.def("expert_rows", &expert_rows, "x [B, K] times one MXFP4 matrix as the decode step's experts",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("variant") = "auto", py::arg("int8_x") = false);
  m.def("gated_activation", &gated_activation, "act(g, u) elementwise, as the MLPs and experts apply it",
        py::arg("g"), py::arg("u"), py::arg("act"), py::arg("beta") = 0.0, py::arg("linear_beta") = 0.0);
  m.def("tile_rows", &tile_rows, "a BF16 [N, K] matrix in the layout the decode kernels read fastest: [N/8, K/8, 8, 8]",
        py::arg("w"));
  m.def("pair_rows", &decode_paired::pair_rows,
        "a BF16 [N, K] matrix laid out for bf16 products (vectors rounded to bf16): [N/16, K/2, 16, 2]", py::arg("w"));
  m.def("short_rows_one_by_one", &decode_native::read_short_rows_one_by_one,
        "whether short fp32 rows are read one at a time (Zen 3) rather than in tiles");
  m.def("tiled_rows_ask_ahead", &decode_native::ask_tiled_rows_ahead,
        "whether tiled BF16 rows read for one vector ask for their lines ahead (all CPUs but Zen 4)");
  m.def("bf16_products_supported", &decode_paired::supported, "whether this CPU has AVX-512 BF16 (bf16 products)");
  m.def("rows_from_blocks", &rows_from_blocks,
        "rows [start, stop) of a BF16 matrix in blocks (tiled or paired) written in rows into out, float32 or bfloat16",
        py::arg("w"), py::arg("start"), py::arg("stop"), py::arg("out"));
  m.def("on_huge_pages", &on_huge_pages, "copies of the tensors packed into one allocation on huge pages, each its own storage",
        py::arg("tensors"));
  m.def("dense_rows_product", &dense_rows_product, "x [B, K] times one fp32 or BF16 matrix as the decode step does",
        py::arg("x"), py::arg("w"), py::arg("variant") = "auto", py::arg("short_rows") = "auto");
  m.def("weighted_rows_product", &weighted_rows_product, "sum_t a[j, t] c[t, :] as MLA's decode step sums its cache",
        py::arg("a"), py::arg("c"), py::arg("variant") = "auto");
  m.def("gemv_variant", &mxfp4_rows512::gemv_variant, "the MXFP4 GEMV at one row in use: 'avx512' or 'avx2'");
  m.def("attn_res_read", &attn_res_read, "an AttnRes read over the values [B, D] each", py::arg("values"),
        py::arg("norm_w"), py::arg("proj_w"), py::arg("eps"));
  m.def("project", &project_all, "x [B, K] (normalised if norm_w is given) times each matrix", py::arg("x"),
        py::arg("norm_w"), py::arg("norm_eps"), py::arg("matrices"));
  py::class_<ExpertTable>(m, "ExpertTable", "every routed expert of one MoE layer, for decoder_layers")
      .def(py::init<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<py::object>>(),
           py::arg("dense"), py::arg("packed"), py::arg("scale"), py::arg("quantized"));
  m.def("decoder_layers", &decoder_layers,
        "a decode step from its tokens to the output read in one call: (h, each layer's next cache state)",
        py::arg("ids"), py::arg("table"), py::arg("block_size"), py::arg("layers"), py::arg("ffn"),
        py::arg("output_read"));
  K3_NATIVE_COMMON(m);  // source_hash, cpu_supported(), cpu_features()
}
