// A decode step's decoder layers in one call (k3/model/fused.py `decoder_layers`): the loop that
// K3Model.forward runs in Python, with the same kernels in the same order, so the same bits.
//
// x = the tokens' embedding rows; then per layer, in order:
//   x = the mixer's read of the residual stream (AttnRes over the finished blocks and the open one; a new block
//       starts at layers that are multiples of block_size)
//   partial += kda_mixer(x, ...) or mla_mixer(x, ...)
//   y = the FFN's read;  partial += mlp(y, ...) or the MoE (moe_route, then `ffn` picks the experts) or `ffn`
// and last the output read (the final norm goes with lm_head: fused.lm_head_logits).
//
// Python builds each layer's arguments (its weights kept between steps by fused.DecodePlan, which sees a replaced
// weight or a changed mode; nothing is kept here), every routed expert's matrices in an ExpertTable where it
// can, so that the loop picks each step's experts itself; `ffn(index, y, route)` is called back for what stays
// in Python: experts read on demand, chosen experts in two modes, or a whole FFN that takes the general path.
// Each Python op between native calls costs 10-30 us more than alone: the weights the kernels stream push the
// interpreter's and the dispatcher's code and data out of the caches (a `mini` step, Zen 3: the embedding 65 us,
// the output read 45, the final norm's five ops 110), so the step's ends are here too.
//
// Included by _native.cpp after the kernels it calls.
#pragma once

#include <torch/extension.h>

#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace decode_native {

namespace py = pybind11;

// f(x, args[0], args[1], ...) with each element of the Python tuple cast to the parameter's type. The GIL stays
// held, as in the kernels' own bindings: released around each kernel, every return waits for any busy Python
// thread to hand it back (tried: 20 `mini` steps beside a spinning thread took 861 ms against 201 held).
template <typename R, typename X, typename... A, std::size_t... I>
R call_unpacked(R (*f)(const X&, A...), const X& x, const py::tuple& args, std::index_sequence<I...>) {
  return f(x, args[I].template cast<std::decay_t<A>>()...);
}

template <typename R, typename X, typename... A>
R call_with(R (*f)(const X&, A...), const X& x, const py::handle& args, const char* what) {
  TORCH_CHECK(py::isinstance<py::tuple>(args), what, ": the arguments must be a tuple");
  const py::tuple t = py::reinterpret_borrow<py::tuple>(args);
  TORCH_CHECK(t.size() == sizeof...(A), what, ": expected ", sizeof...(A), " arguments, got ", t.size());
  return call_unpacked(f, x, t, std::index_sequence_for<A...>{});
}

// moe_experts with its first three arguments as moe_route returns them ({xn, z, weights, indices}), for
// call_with.
inline Tensor moe_experts_of_route(const std::vector<Tensor>& route, const std::vector<int64_t>& slots,
                                   const std::vector<Tensor>& dense, const std::vector<Tensor>& packed,
                                   const std::vector<Tensor>& scale, int64_t act, double beta, double linear_beta,
                                   const Optional& latent_norm_w, double latent_eps, const Optional& w_up,
                                   const Optional& shared_gate, const Optional& shared_up,
                                   const Optional& shared_down, const std::string& variant, bool int8_x) {
  return moe_experts(route[0], route[1], route[2], slots, dense, packed, scale, act, beta, linear_beta,
                     latent_norm_w, latent_eps, w_up, shared_gate, shared_up, shared_down, variant, int8_x);
}

// Every routed expert of one MoE layer, as moe_experts takes the chosen ones: (w1, w3, w2) of expert e at
// 3e .. 3e + 2 of `dense` (fp32 or BF16) or of `packed` + `scale` (MXFP4), and for MXFP4 the modules whose
// `int8_inputs` each step reads (the Python side's MXFP4Linear; read live, as the layers one by one read it).
// Built once by fused.DecodePlan (fused.expert_table), so that the loop picks a step's experts without
// returning to Python.
struct ExpertTable {
  std::vector<Tensor> dense, packed, scale;
  std::vector<py::object> quantized;
  int64_t experts = 0;

  ExpertTable(std::vector<Tensor> dense_, std::vector<Tensor> packed_, std::vector<Tensor> scale_,
              std::vector<py::object> quantized_)
      : dense(std::move(dense_)), packed(std::move(packed_)), scale(std::move(scale_)),
        quantized(std::move(quantized_)) {
    const bool is_packed = dense.empty();
    const size_t n = is_packed ? packed.size() : dense.size();
    TORCH_CHECK(n > 0 && n % 3 == 0 && (is_packed ? scale.size() == n && quantized.size() == n : packed.empty()),
                "an expert table holds (w1, w3, w2) of every expert: fp32 / BF16 in `dense`, or MXFP4 in "
                "`packed` + `scale` with their modules in `quantized`");
    experts = static_cast<int64_t>(n / 3);
  }
};

// moe_experts for the experts moe_route chose (route[3], [B, k]), each distinct one once in order of first
// choice as fused.moe_experts_arguments orders them, with `tail` (moe_experts' arguments from act to
// shared_down); nullopt when the chosen MXFP4 matrices are in two `int8_inputs` modes (each its own forward:
// the caller asks Python).
inline std::optional<Tensor> table_experts(const ExpertTable& table, const std::vector<Tensor>& route,
                                           const py::tuple& tail) {
  TORCH_CHECK(tail.size() == 9, "the experts' tail: (act, beta, linear_beta, latent_norm_w, latent_eps, up_w, "
                                "shared_gate, shared_up, shared_down)");
  const Tensor& indices = route[3];
  const int64_t pairs = indices.numel();
  const int64_t* chosen = indices.data_ptr<int64_t>();
  std::vector<int64_t> slot_of(table.experts, -1), distinct, slots(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t e = chosen[i];
    TORCH_CHECK(0 <= e && e < table.experts, "the router chose expert ", e, " of ", table.experts);
    if (slot_of[e] < 0) {
      slot_of[e] = static_cast<int64_t>(distinct.size());
      distinct.push_back(e);
    }
    slots[i] = slot_of[e];
  }
  std::vector<Tensor> dense, packed, scale;
  std::optional<bool> int8_x;
  for (const int64_t e : distinct)
    for (int64_t m = 3 * e; m < 3 * e + 3; ++m) {
      if (table.dense.empty()) {
        packed.push_back(table.packed[m]);
        scale.push_back(table.scale[m]);
        const bool mode = table.quantized[m].attr("int8_inputs").cast<bool>();
        if (int8_x.has_value() && *int8_x != mode) return std::nullopt;
        int8_x = mode;
      } else {
        dense.push_back(table.dense[m]);
      }
    }
  return moe_experts(route[0], route[1], route[2], slots, dense, packed, scale, tail[0].cast<int64_t>(),
                     tail[1].cast<double>(), tail[2].cast<double>(), tail[3].cast<Optional>(), tail[4].cast<double>(),
                     tail[5].cast<Optional>(), tail[6].cast<Optional>(), tail[7].cast<Optional>(),
                     tail[8].cast<Optional>(), "auto", int8_x.value_or(false));
}

// The residual stream of one step: finished blocks and the open block's partial sum (k3.model.attn_res).
struct Stream {
  std::vector<Tensor> blocks;
  Tensor partial;      // undefined right after a block closes
  bool owned = false;  // partial is the stream's own tensor, which no one else holds: updates go into it

  // A read site: AttnRes over [blocks..., partial] with weights (norm_w, proj_w, eps), or the partial sum while
  // no block is finished; `weights` None: a model without AttnRes (the plain residual stream). The partial sum
  // handed out is no longer written into (a Python FFN, or its hooks, may keep it).
  Tensor read(const py::handle& weights) {
    if (weights.is_none() || blocks.empty()) {
      TORCH_CHECK(partial.defined(), "the residual stream has no open block to read");
      owned = false;
      return partial;
    }
    const py::tuple w = py::reinterpret_borrow<py::tuple>(weights);
    std::vector<Tensor> values;
    for (const Tensor& b : blocks) values.push_back(b.contiguous());
    if (partial.defined()) values.push_back(partial.contiguous());
    return attn_res_read(values, w[0].cast<Tensor>(), w[1].cast<Tensor>(), w[2].cast<double>());
  }

  // partial += update. A block's first update (its first layer's mixer output) is taken as it is, the next sum
  // is a new tensor of the stream's own, and later ones are added into it in place where axpy can pair their
  // elements in memory order (same shape, both contiguous fp32): the same bits, one aten add a block instead of
  // one an update (with moe_experts' own sum, a `mini` step's aten ops 139 -> 111; its time within the noise,
  // Zen 3).
  void add(const Tensor& update) {
    if (!partial.defined()) {
      partial = update;
      owned = false;
    } else if (owned && update.sizes() == partial.sizes() && update.is_contiguous() && partial.is_contiguous() &&
               update.scalar_type() == torch::kFloat32 && partial.scalar_type() == torch::kFloat32) {
      axpy(1.0f, update.data_ptr<float>(), partial.numel(), partial.data_ptr<float>());  // 1 x + y: one rounding
    } else {  // torch's add: any layout, dtype or broadcast an FFN from Python may return
      partial = partial + update;
      owned = true;
    }
  }
};

// The rows of `table` [V, H] (fp32, or BF16: exact in fp32) of the tokens ids [B, 1]: [B, 1, H] fp32, as
// K3Model.forward's embedding taken to fp32.
inline Tensor embedding_rows(const Tensor& ids, const Tensor& table) {
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) == 1 && ids.scalar_type() == torch::kLong && ids.is_contiguous(),
              "ids must be a contiguous int64 [B, 1], got ", ids.sizes(), " ", ids.scalar_type());
  const bool bf16 = table.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || table.scalar_type() == torch::kFloat32) && table.dim() == 2 && table.is_contiguous() &&
                  table.device().is_cpu(),
              "the embedding table must be a contiguous fp32 or bfloat16 CPU [V, H], got ", table.sizes(), " ",
              table.scalar_type());
  const int64_t B = ids.size(0), V = table.size(0), H = table.size(1);
  Tensor out = torch::empty({B, 1, H}, table.options().dtype(torch::kFloat32));
  const int64_t* id = ids.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= id[b] && id[b] < V, "token id ", id[b], " is outside the vocabulary [0, ", V, ")");
    if (bf16) {
      const auto* row = static_cast<const uint16_t*>(table.data_ptr()) + id[b] * H;
      for (int64_t i = 0; i < H; ++i) o[b * H + i] = to_float(row[i]);
    } else {
      std::memcpy(o + b * H, table.data_ptr<float>() + id[b] * H, H * sizeof(float));
    }
  }
  return out;
}

// ids [B, 1]: the step's tokens, `table` their embedding (embedding_rows).
// layers: one tuple per layer, (index, mixer_read, ffn_read, mixer_kind, mixer_args, ffn_kind, ffn_args):
//   mixer_read / ffn_read  (norm_w fp32, proj_w fp32, eps) of the AttnRes read sites, or None (no AttnRes)
//   mixer_kind "kda"       mixer_args: kda_mixer's arguments after x
//              "mla"       mla_mixer's arguments after x (the cache must have room)
//   ffn_kind   "mlp"       ffn_args: mlp's arguments after x
//              "moe"       (moe_route's arguments after x, an ExpertTable or None, the experts' tail for
//                          table_experts); with a table the loop picks the chosen experts itself, else (or
//                          when their int8 modes differ) ffn(index, y, (xn, z, weights, indices)) returns
//                          moe_experts' arguments after (xn, z, weights), or the FFN's update
//              "python"    ffn(index, y, None) returns the FFN's update
// output_read: the output's read site as a layer's, or None (no AttnRes: the running sum).
// Returns (h, states): h [B, 1, H] the output read after the last layer, before the final norm; per layer, in
// order, what its cache holds next: a KDA layer's kda_mixer outputs after its update (new conv tails, the
// recurrent state), an MLA layer's lengths + 1 (its token was written at lengths[b]).
py::tuple decoder_layers(const Tensor& ids, const Tensor& table, int64_t block_size, const py::list& layers,
                         const py::function& ffn, const py::object& output_read) {
  Stream stream{{}, embedding_rows(ids, table)};
  py::list states;
  for (const py::handle& layer : layers) {
    const py::tuple l = py::reinterpret_borrow<py::tuple>(layer);
    TORCH_CHECK(l.size() == 7, "a layer is (index, mixer_read, ffn_read, mixer_kind, mixer_args, ffn_kind, ffn_args)");
    const int64_t index = l[0].cast<int64_t>();
    const Tensor mixer_in = stream.read(l[1]);
    if (!l[1].is_none() && block_size > 0 && index % block_size == 0) {  // a new block starts at this layer
      stream.blocks.push_back(stream.partial);
      stream.partial = Tensor();
    }
    const std::string mixer = l[3].cast<std::string>();
    if (mixer == "kda") {
      std::vector<Tensor> out = call_with(kda_mixer, mixer_in, l[4], "kda_mixer");
      stream.add(out[0]);
      states.append(py::make_tuple(out[1], out[2], out[3], out[4]));
    } else {
      TORCH_CHECK(mixer == "mla", "mixer_kind must be 'kda' or 'mla', got ", mixer);
      std::vector<Tensor> out = call_with(mla_mixer, mixer_in, l[4], "mla_mixer");
      stream.add(out[0]);
      states.append(py::make_tuple(out[1]));
    }
    const Tensor y = stream.read(l[2]);
    const std::string kind = l[5].cast<std::string>();
    if (kind == "mlp") {
      stream.add(call_with(mlp, y, l[6], "mlp"));
    } else if (kind == "moe") {
      const py::tuple moe = l[6].cast<py::tuple>();
      TORCH_CHECK(moe.size() == 3, "an MoE's ffn_args are (route arguments, expert table or None, experts' tail)");
      const std::vector<Tensor> route = call_with(moe_route, y, moe[0], "moe_route");
      std::optional<Tensor> update;
      if (!moe[1].is_none()) update = table_experts(moe[1].cast<const ExpertTable&>(), route, moe[2].cast<py::tuple>());
      if (!update.has_value()) {
        const py::object chosen = ffn(index, y, py::make_tuple(route[0], route[1], route[2], route[3]));
        update = py::isinstance<py::tuple>(chosen) ? call_with(moe_experts_of_route, route, chosen, "moe_experts")
                                                   : chosen.cast<Tensor>();  // the FFN's update, general path
      }
      stream.add(*update);
    } else {
      TORCH_CHECK(kind == "python", "ffn_kind must be 'mlp', 'moe' or 'python', got ", kind);
      stream.add(ffn(index, y, py::none()).cast<Tensor>());
    }
  }
  return py::make_tuple(stream.read(output_read), states);
}

}  // namespace decode_native
