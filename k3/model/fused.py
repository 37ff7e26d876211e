"""The fused decode step: one token per sequence, each mixer and each FFN of a layer in one native call.

`K3DecoderLayer.forward` asks these functions first on one-token forwards that continue a cache; each returns
the layer's update (the same value as the general path, to rounding: tests/model/test_fused_decode.py) or
None, and then the general path runs. They apply when no gradient is recorded (the kernels of k3.ops.decode
have no backward), the kernels are built, the activations are fp32 on the CPU and the weights fp32 or BF16 (as
the published checkpoint stores every non-expert weight: the kernels read a BF16 matrix as fp32 in registers;
a norm's or gate's small vectors are converted per call), routed experts fp32, BF16 or MXFP4 (exact, or with
inputs rounded to int8 where the experts' `int8_inputs` say so: k3.ops.mxfp4.int8_x). Modules' forwards are
not called, so their hooks do not run, except that the MoE takes the general path while its router has hooks
(`record_routing`, `route_with`) or its `dispatch` is replaced on the instance (k3.dist's expert parallelism).

A decode step of `mini` runs 27 such calls (6 KDA, 3 MLA, 1 dense MLP, 8 x 2 MoE, lm_head) plus its AttnRes
reads, where the general path dispatches ~3,000 aten ops (benchmarks/decode.py --step-profile).

`decoder_layers` runs a whole step but the final norm and lm_head in one native call instead (K3Model.forward
asks it first unless `set_fast_decode(True, one_call=False)`): the same functions build each piece's
arguments, once (a DecodePlan keeps the weights and constants while nothing replaces them; each step adds the
cache's states), the loop (the embedding rows, AttnRes reads, residual adds, the kernels in the same order,
the output read) runs in k3/ops/decode/_native_step.h and picks each MoE layer's experts itself from a table
of all of them (`expert_table`), returning to Python only for experts read on demand, chosen experts in two
modes or an FFN's general forward, so the bits are those of the layers one by one
(tests/model/test_decoder_layers.py). On both routes a step's final norm runs in lm_head's call
(`lm_head_logits`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from types import ModuleType

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from k3.model.activations import native_activation
from k3.model.attn_res import native_read_weights
from k3.model.cache import KDAState, LayerState, MLAState
from k3.model.kda import KDAttention
from k3.model.mla import MLAttention
from k3.model.mlp import MLP
from k3.model.moe import ExpertMatrices, MoE, expert_matrices, native_expert_weights
from k3.model.norm import NATIVE_WEIGHT_DTYPES, Linear, RMSNorm, child, parameter
from k3.ops.decode.native import load_native
from k3.ops.mxfp4 import MXFP4Linear


def _weight(module: torch.nn.Module, name: str) -> torch.Tensor:
    """`module.<name>.weight`, read from the module dicts (k3.model.norm.parameter)."""
    return parameter(child(module, name), "weight")


def _weights(module: torch.nn.Module, *names: str) -> list[torch.Tensor]:
    """The weights of these children of `module`, in order."""
    return [_weight(module, name) for name in names]


def _children(module: nn.Module, *names: str) -> list[nn.Module]:
    """These children of `module`, in order."""
    return [child(module, name) for name in names]


def _native(x: torch.Tensor, tensors: list[torch.Tensor | None]) -> ModuleType | None:
    """The kernels, if they may run on x [B, 1, H] and these weights (None entries are absent ones)."""
    if torch.is_grad_enabled() or x.dtype != torch.float32 or not x.is_cpu:
        return None
    if any(t is not None and t.dtype not in NATIVE_WEIGHT_DTYPES for t in tensors):
        return None
    return load_native()


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A small weight (a norm's, a gate's constants, a short convolution) as the kernels take it: fp32."""
    return t if t is None or t.dtype == torch.float32 else t.float()


def mixer_update(
    norm: RMSNorm, mixer: KDAttention | MLAttention, x: torch.Tensor, state: LayerState
) -> torch.Tensor | None:
    """mixer(norm(x), state) for x [B, 1, hidden], updating `state`; None: take the general path."""
    if isinstance(mixer, KDAttention) and isinstance(state, KDAState):
        return kda_update(norm, mixer, x, state)
    if isinstance(mixer, MLAttention) and isinstance(state, MLAState):
        return mla_update(norm, mixer, x, state)
    return None


def kda_update(norm: RMSNorm, kda: KDAttention, x: torch.Tensor, state: KDAState) -> torch.Tensor | None:
    args = kda_arguments(norm, kda, x, state)
    if args is None:
        return None
    native = load_native()
    update, state.conv_q, state.conv_k, state.conv_v, state.recurrent = native.kda_mixer(
        x.contiguous(), *args
    )
    return update


def kda_arguments(norm: RMSNorm, kda: KDAttention, x: torch.Tensor, state: KDAState) -> tuple | None:
    """kda_mixer's arguments after x [B, 1, hidden] (the recurrent state is updated in place; the new
    convolution tails come back with the update), or None: take the general path."""
    weights, states = kda_weights(norm, kda, x), kda_states(state)
    return None if weights is None or states is None else with_states(weights, states)


def kda_weights(norm: RMSNorm, kda: KDAttention, x: torch.Tensor) -> tuple[tuple, tuple] | None:
    """kda_mixer's arguments before and after the state's (with_states), or None: take the general path."""
    # Each weight is looked up once (a step runs this for every KDA layer: lookups cost as much as math here).
    w_q, w_k, w_v, w_fa, w_fb, w_b, o_norm, w_o = _weights(
        kda, "q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "o_norm", "o_proj"
    )
    convs = _weights(kda, "q_conv1d", "k_conv1d", "v_conv1d")  # [P, 1, ks] each
    w_gate, w_gate_b = (
        (_weight(kda, "g_proj"), None) if kda.full_rank_gate else _weights(kda, "g_a_proj", "g_b_proj")
    )
    norm_w, a_log, dt_bias = parameter(norm, "weight"), parameter(kda, "A_log"), parameter(kda, "dt_bias")
    weights = [norm_w, w_q, w_k, w_v, *convs, w_fa, w_fb, a_log, dt_bias, w_b, w_gate, w_gate_b, o_norm, w_o]
    if _native(x, weights) is None:
        return None
    before = (
        _f32(norm_w),
        norm.eps,
        w_q,
        w_k,
        w_v,
        *(_f32(w) for w in convs),
        w_fa,
        w_fb,
        _f32(a_log),
        _f32(dt_bias),
        kda.lower_bound,  # None: Kimi Linear's softplus gate
        w_b,
        w_gate,
        w_gate_b,
        _f32(o_norm),
        child(kda, "o_norm").eps,
        w_o,
    )
    return before, (kda.l2norm_eps, kda.head_dim**-0.5)


def kda_states(state: KDAState) -> tuple | None:
    """kda_mixer's state arguments, or None when nothing was prefilled (the general path starts the state)."""
    if state.recurrent is None or state.conv_q is None or state.conv_k is None or state.conv_v is None:
        return None
    return (
        state.conv_q.contiguous(),  # [B, width, P]: the convolutions' last inputs
        state.conv_k.contiguous(),
        state.conv_v.contiguous(),
        state.recurrent.contiguous(),  # [B, heads, K, V], updated in place (and returned)
    )


def with_states(weights: tuple[tuple, tuple], states: tuple) -> tuple:
    """A mixer kernel's arguments: its weights' (before, after) parts around the cache's state."""
    before, after = weights
    return (*before, *states, *after)


def mla_update(norm: RMSNorm, mla: MLAttention, x: torch.Tensor, state: MLAState) -> torch.Tensor | None:
    args = mla_arguments(norm, mla, x, state)
    if args is None:
        return None
    update, state.lengths = load_native().mla_mixer(x.contiguous(), *args)  # wrote each latent at lengths[b]
    return update


def mla_arguments(norm: RMSNorm, mla: MLAttention, x: torch.Tensor, state: MLAState) -> tuple | None:
    """mla_mixer's arguments after x [B, 1, hidden], the cache given room for one more token (the call
    returns the lengths advanced), or None: take the general path."""
    weights = mla_weights(norm, mla, x)
    states = None if weights is None else mla_states(state)
    return None if states is None else with_states(weights, states)  # type: ignore[arg-type]


def mla_weights(norm: RMSNorm, mla: MLAttention, x: torch.Tensor) -> tuple[tuple, tuple] | None:
    """mla_mixer's arguments before and after the cache's (with_states), or None: take the general path."""
    w_q, q_norm, w_q_b = (
        _weights(mla, "q_a_proj", "q_a_layernorm", "q_b_proj")
        if mla.q_lora
        else (_weight(mla, "q_proj"), None, None)
    )
    w_g = _weight(mla, "g_proj") if mla.output_gate else None
    w_kv_a, kv_norm, w_kv_b, w_o = _weights(
        mla, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"
    )
    norm_w = parameter(norm, "weight")
    if _native(x, [norm_w, w_q, q_norm, w_q_b, w_kv_a, kv_norm, w_kv_b, w_g, w_o]) is None:
        return None
    before = (
        _f32(norm_w),
        norm.eps,
        w_q,
        _f32(q_norm),
        w_q_b,
        child(mla, "kv_a_layernorm").eps,
        w_kv_a,
        _f32(kv_norm),
        w_kv_b,
        w_g,
        w_o,
    )
    return before, (mla.num_heads, mla.nope, mla.rope, mla.v_dim, mla.scale)


def mla_states(state: MLAState) -> tuple | None:
    """mla_mixer's cache arguments, given room for one more token, or None: nothing prefilled (the general
    path allocates the cache) or a cache in another dtype."""
    if state.latent is None or state.k_rope is None or state.latent.dtype != torch.float32:
        return None
    state.reserve(1)
    return state.latent, state.k_rope, state.lengths


def ffn_update(norm: RMSNorm, ffn: MLP | MoE, y: torch.Tensor) -> torch.Tensor | None:
    """ffn(norm(y)) for y [B, 1, hidden]; None: take the general path."""
    if isinstance(ffn, MLP):
        return mlp_update(norm, ffn, y)
    return moe_update(norm, ffn, y) if isinstance(ffn, MoE) else None


def mlp_update(norm: RMSNorm, mlp: MLP, y: torch.Tensor) -> torch.Tensor | None:
    args = mlp_arguments(norm, mlp, y)
    return None if args is None else load_native().mlp(y.contiguous(), *args)


def moe_update(norm: RMSNorm, moe: MoE, y: torch.Tensor) -> torch.Tensor | None:
    found = moe_route_arguments(norm, moe, y)
    if found is None:
        return None
    route, experts_tail = found
    native = load_native()
    xn, z, mixing, indices = native.moe_route(y.contiguous(), *route)
    args = moe_experts_arguments(moe, indices, experts_tail)
    return None if args is None else native.moe_experts(xn, z, mixing, *args)


def _capped(ffn: MLP | MoE) -> bool:
    """Whether the kernels compute this FFN's activation: SiLU-GLU or a capped SiTU (they cap the up
    projection; an uncapped SiTU takes the general path)."""
    return ffn.situ is None or ffn.situ[1] is not None


def mlp_arguments(norm: RMSNorm, mlp: MLP, y: torch.Tensor) -> tuple | None:
    """mlp's arguments after y [B, 1, hidden] (the norm included), or None: take the general path."""
    if not _capped(mlp):
        return None
    norm_w = parameter(norm, "weight")
    matrices = _weights(mlp, "gate_proj", "up_proj", "down_proj")
    if _native(y, [norm_w, *matrices]) is None:
        return None
    return (_f32(norm_w), norm.eps, *matrices, *native_activation(mlp.situ))


def moe_route_arguments(norm: RMSNorm, moe: MoE, y: torch.Tensor) -> tuple[tuple, tuple] | None:
    """(moe_route's arguments after y [B, 1, hidden], the MoE's part of moe_experts' arguments), or None:
    take the general path."""
    return None if routed_elsewhere(moe) else moe_route_weights(norm, moe, y)


def routed_elsewhere(moe: MoE) -> bool:
    """Whether the MoE must run its general forward: its router has hooks (recorded or replayed routing) or
    it has a dispatch of its own (k3.dist's expert parallelism)."""
    router = child(moe, "gate")
    return bool(router._forward_hooks or router._forward_pre_hooks) or "dispatch" in moe.__dict__


def moe_route_weights(norm: RMSNorm, moe: MoE, y: torch.Tensor) -> tuple[tuple, tuple] | None:
    """moe_route_arguments whatever `routed_elsewhere` says."""
    if not _capped(moe):
        return None
    router = child(moe, "gate")
    dense_parts = _dense_parts(moe)
    if dense_parts is None:  # MXFP4 latent projections or shared experts: the kernel takes plain ones
        return None
    down, up, shared = dense_parts
    latent_norm = child(moe, "routed_expert_norm") if moe.latent_norm else None
    latent_norm_w = None if latent_norm is None else parameter(latent_norm, "weight")
    norm_w = parameter(norm, "weight")
    router_w, bias = parameter(router, "weight"), parameter(router, "e_score_correction_bias")
    if _native(y, [norm_w, router_w, bias, down, up, *shared, latent_norm_w]) is None:
        return None
    route = (
        _f32(norm_w),
        norm.eps,
        router_w,
        _f32(bias),
        router.num_groups,
        router.topk_groups,
        router.top_k,
        router.renormalize,
        router.scaling,
        down,
    )
    experts_tail = (
        *native_activation(moe.situ),
        _f32(latent_norm_w),
        0.0 if latent_norm is None else latent_norm.eps,
        up,
        *shared,
    )
    return route, experts_tail


def moe_experts_arguments(
    moe: MoE, indices: torch.Tensor, experts_tail: tuple, known: dict | None = None
) -> tuple | None:
    """moe_experts' arguments after (xn, z, weights) for the experts `indices` [B, k] chose, or None when
    they cannot run in one call (mixed kinds, or some exact and some approximate: each its own forward).
    `known`: the experts' matrices looked up at earlier steps (native_expert_weights)."""
    if moe.load_experts is not None:  # k3.model.on_demand: read the chosen experts not read yet
        moe.load_experts(indices)
    chosen = [e for row in indices.tolist() for e in row]  # [B * k], row-major
    distinct = list(dict.fromkeys(chosen))  # each chosen expert once, in order of first choice
    slot = {e: i for i, e in enumerate(distinct)}
    experts = child(moe, "experts")._modules  # {"0": RoutedExpert, ...}: cheaper than ModuleList indexing
    found = native_expert_weights([experts[str(e)] for e in distinct], known)  # type: ignore[misc]
    if found is None:
        return None
    return (
        [slot[e] for e in chosen],  # row-major [B, k]: each pair's position in `distinct`
        found.dense,
        found.packed,
        found.scale,
        *experts_tail,
        "auto",  # the kernel variant: the widest this CPU has (the same bits)
        found.int8_x,
    )


def expert_table(moe: MoE) -> object | None:
    """Every routed expert's matrices of `moe` as the native loop picks a step's experts from them (an
    ExpertTable, _native_step.h), or None: experts read on demand, or not all of one kind the kernels take
    (fp32 / BF16 Linears, or MXFP4), so each step asks Python (moe_experts_arguments)."""
    if moe.load_experts is not None:
        return None
    found = [expert_matrices(expert) for expert in child(moe, "experts")._modules.values()]
    usable = [m for m in found if m is not None]
    if not usable or len(usable) < len(found) or len({bool(m.packed) for m in usable}) > 1:
        return None
    gathered = ([t for m in usable for t in getattr(m, part)] for part in ExpertMatrices._fields)
    return load_native().ExpertTable(*gathered)


def _dense_parts(
    moe: MoE,
) -> tuple[torch.Tensor | None, torch.Tensor | None, list[torch.Tensor | None]] | None:
    """The MoE's latent down- and up-projection weights (None without a latent) and its shared experts' gate,
    up and down weights ([None] * 3 without); None when any of them is MXFP4 (a checkpoint packed them)."""
    latent = ("routed_expert_down_proj", "routed_expert_up_proj")
    parts = [child(moe, name) for name in latent] if moe.latent else [None, None]
    if moe.shared:
        shared_experts = child(moe, "shared_experts")
        parts += [child(shared_experts, name) for name in ("gate_proj", "up_proj", "down_proj")]
    else:
        parts += [None, None, None]
    if any(isinstance(p, MXFP4Linear) for p in parts):
        return None
    down, up, *shared = (None if p is None else parameter(p, "weight") for p in parts)
    return down, up, shared


class DecodePlan:
    """What `decoder_layers` gives the kernels of each layer and of the output read that stays the same from
    step to step (weights, constants, which kernels run), looked up once and reused: looking them up took ~30
    us of Python a layer (some 25 dict reads and checks), 60 us between kernels that stream megabytes, as much
    as a small layer's kernels, and each MoE layer's table of every routed expert's matrices (`expert_table`).
    Each step still reads what may change between steps: the cache's states, the router hooks and dispatch
    `routed_elsewhere` looks at, an MoE's `load_experts`, and the chosen experts' `int8_inputs` modes.

    A plan is cleared, to be built again at the next step, when any module registers a parameter, buffer or
    submodule (torch's global registration hooks: a replaced weight or layer, `tile_weights`,
    `load_state_dict(assign=True)`), when its model is converted (`K3Model._apply`: `.to`, `.float`) or
    `set_fast_decode` is called, and when a weight it converted to fp32 for the kernels (a BF16 norm's, say)
    changed in place or took other data. Weights in fp32 are the kernels' own inputs: changed in place, they
    are read as they are. (Giving an fp32 weight another dtype through `.data`, which no hook sees, needs
    `set_fast_decode` again.)"""

    def __init__(self) -> None:
        self.layers: list[tuple] | None = None  # _layer_plan's, one a layer; None: not built
        self.output_read: tuple | None = None  # the output's AttnRes read weights (native_read_weights)
        self.runs_natively = False  # whether every layer's mixer and reads can run in the kernels
        self.experts_tails: dict[int, tuple] = {}  # MoE layer index -> its part of moe_experts' arguments
        self.by_index: dict[int, nn.Module] = {}
        self.converted: list[tuple[torch.Tensor, int, int]] = []  # (copied to fp32, _version, data_ptr)
        self.experts: dict[nn.Module, ExpertMatrices | None] = {}  # each routed expert once it was chosen
        self.builds = 0
        self.activations = torch.empty(0, device="cpu")  # like a step's activations (fp32, CPU): for _native
        _PLANS.add(self)

    def __reduce__(self) -> tuple:
        return DecodePlan, ()  # a copied or unpickled model starts with an empty plan of its own

    def clear(self) -> None:
        self.layers, self.output_read, self.experts_tails, self.by_index = None, None, {}, {}
        self.converted, self.experts = [], {}

    def specs(self, model: nn.Module, states: Sequence[LayerState]) -> list[tuple] | None:
        """The layers of K3Model `model` as `decoder_layers` takes them this step; None when a mixer or a read
        cannot run natively."""
        if self.layers is None or any(t._version != v or t.data_ptr() != at for t, v, at in self.converted):
            self._build(model)
        if not self.runs_natively:
            return None
        specs = []
        for layer, state in zip(self.layers or [], states, strict=True):
            index, reads, mixer_kind, weights, ffn_kind, ffn_args, moe = layer
            if isinstance(state, KDAState):
                found = kda_states(state) if mixer_kind == "kda" else None
            else:
                found = mla_states(state) if mixer_kind == "mla" and isinstance(state, MLAState) else None
            if found is None:
                return None
            if moe is not None and routed_elsewhere(moe):
                ffn_kind, ffn_args = "python", None
            elif moe is not None and moe.load_experts is not None:  # read on demand: Python picks them
                ffn_args = (ffn_args[0], None, ffn_args[2])
            specs.append((index, *reads, mixer_kind, with_states(weights, found), ffn_kind, ffn_args))
        return specs

    def _build(self, model: nn.Module) -> None:
        self.clear()
        self.builds += 1
        layers = list(child(model, "layers"))
        built = [_layer_plan(layer, self.activations, self.experts_tails) for layer in layers]
        output = (
            _children(model, "output_attn_res_norm", "output_attn_res_proj") if model.uses_attn_res else []
        )
        self.output_read = native_read_weights(*output) if output else None
        self.runs_natively = None not in built and (self.output_read is not None or not output)
        self.layers = built  # type: ignore[assignment]
        self.by_index = {layer.index: layer for layer in layers}
        self.converted = [  # what _f32 or an AttnRes read may copy to fp32 (not experts: picked per step)
            (t, t._version, t.data_ptr())
            for module in (*layers, *output)
            for t in _tensors_but_experts(module)
            if t.is_floating_point() and t.dtype != torch.float32
        ]


def _tensors_but_experts(module: nn.Module) -> Iterator[torch.Tensor]:
    """The parameters and buffers of `module` and its submodules but the routed experts (64-896 a layer)."""
    for name, sub in module._modules.items():
        if name != "experts" and sub is not None:
            yield from _tensors_but_experts(sub)
    yield from (t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None)


# Every live plan, cleared by torch's global registration hooks (see DecodePlan).
_PLANS: weakref.WeakSet[DecodePlan] = weakref.WeakSet()


def _clear_plans(*_registration: object) -> None:
    for plan in list(_PLANS):
        plan.clear()


register_module_parameter_registration_hook(_clear_plans)
register_module_buffer_registration_hook(_clear_plans)
register_module_module_registration_hook(_clear_plans)


def decoder_layers(
    plan: DecodePlan, model: nn.Module, input_ids: torch.Tensor, states: Sequence[LayerState]
) -> torch.Tensor | None:
    """A decode step of K3Model `model` (`input_ids` [B, 1], the cache's layer `states`) from the tokens'
    embedding rows to the output read in one native call (`decoder_layers`, _native_step.h): the same kernels
    in the same order as the layers one by one, the same bits, without a return to Python per piece. Returns
    the output read h [B, 1, hidden] fp32, before the final norm, or None with nothing done when some mixer or
    read cannot run natively (the caller then runs the layers one by one). `plan` holds what stays the same
    between steps. An FFN the kernels do not take (hooks, another dispatch, mixed experts) runs its general
    forward, called back from the loop."""
    table = parameter(child(model, "embed_tokens"), "weight")  # [V, hidden], fp32 or BF16
    native = _native(plan.activations, [table])
    if native is None or input_ids.shape[1] != 1 or not table.is_cpu or not input_ids.is_cpu:
        return None
    specs = plan.specs(model, states)
    if specs is None:
        return None
    by_index, experts_tails = plan.by_index, plan.experts_tails

    def ffn(index: int, y: torch.Tensor, route: tuple | None) -> tuple | torch.Tensor:
        """The chosen experts' arguments of an MoE layer (`route`: moe_route's outputs), or the FFN's update
        through its general forward."""
        layer = by_index[index]
        if route is not None:
            moe = child(layer, "block_sparse_moe")
            args = moe_experts_arguments(moe, route[3], experts_tails[index], plan.experts)
            if args is not None:
                return args
        return layer.ffn(layer.post_attention_layernorm(y))

    ids = input_ids.long().contiguous()  # the same tensor when it is already
    block_size = model.config.attn_res_block_size or 0
    h, after = native.decoder_layers(ids, table, block_size, specs, ffn, plan.output_read)
    for state, next_state in zip(states, after, strict=True):
        if isinstance(state, KDAState):
            state.conv_q, state.conv_k, state.conv_v, state.recurrent = next_state
        else:
            (state.lengths,) = next_state  # MLA: each row's token was written at lengths[b]
    return h


def _layer_plan(layer: nn.Module, x: torch.Tensor, experts_tails: dict) -> tuple | None:
    """One layer's part of a DecodePlan: (index, AttnRes reads, mixer kind, its weights (kda_weights /
    mla_weights), FFN kind, its arguments, the MoE whose `routed_elsewhere` each step asks, or None); None
    when its mixer or AttnRes reads cannot run natively."""
    reads = (None, None)
    if layer.uses_attn_res:
        reads = (
            native_read_weights(*_children(layer, "self_attention_res_norm", "self_attention_res_proj")),
            native_read_weights(*_children(layer, "mlp_res_norm", "mlp_res_proj")),
        )
        if None in reads:
            return None
    mixer, norm = child(layer, "self_attn"), child(layer, "input_layernorm")
    if isinstance(mixer, KDAttention):
        mixer_kind, weights = "kda", kda_weights(norm, mixer, x)
    elif isinstance(mixer, MLAttention):
        mixer_kind, weights = "mla", mla_weights(norm, mixer, x)
    else:
        return None
    if weights is None:
        return None
    ffn = child(layer, "block_sparse_moe" if layer.is_moe else "mlp")
    norm = child(layer, "post_attention_layernorm")
    ffn_kind, ffn_args, moe = "python", None, None
    if isinstance(ffn, MLP):
        ffn_args = mlp_arguments(norm, ffn, x)
        ffn_kind = "python" if ffn_args is None else "mlp"
    elif isinstance(ffn, MoE) and (found := moe_route_weights(norm, ffn, x)) is not None:
        route, experts_tails[layer.index] = found
        ffn_kind, ffn_args, moe = "moe", (route, expert_table(ffn), experts_tails[layer.index]), ffn
    return (layer.index, reads, mixer_kind, weights, ffn_kind, ffn_args, moe)


def lm_head_logits(lm_head: Linear, h: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor | None:
    """lm_head(norm(h)) for h [B, 1, hidden] (norm None: h as it is) in one native call (its rows split across
    threads); None: general."""
    weight = parameter(lm_head, "weight")
    norm_w = None if norm is None else parameter(norm, "weight")
    native = _native(h, [weight, norm_w])
    if native is None:
        return None
    x = h.contiguous()  # [B, 1, hidden]; h may be the last position of a longer prefill
    return native.project(x, _f32(norm_w), 0.0 if norm is None else norm.eps, [weight])[0]
