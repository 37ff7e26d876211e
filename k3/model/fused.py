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
"""

from __future__ import annotations

from types import ModuleType

import torch

from k3.model.cache import KDAState, LayerState, MLAState
from k3.model.kda import KDAttention
from k3.model.mla import MLAttention
from k3.model.mlp import MLP
from k3.model.moe import MoE, native_activation, native_expert_weights
from k3.model.norm import NATIVE_WEIGHT_DTYPES, Linear, RMSNorm, child, parameter
from k3.ops.decode.native import load_native
from k3.ops.mxfp4 import MXFP4Linear


def _weight(module: torch.nn.Module, name: str) -> torch.Tensor:
    """`module.<name>.weight`, read from the module dicts (k3.model.norm.parameter)."""
    return parameter(child(module, name), "weight")


def _weights(module: torch.nn.Module, *names: str) -> list[torch.Tensor]:
    """The weights of these children of `module`, in order."""
    return [_weight(module, name) for name in names]


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
    if state.recurrent is None or state.conv_q is None or state.conv_k is None or state.conv_v is None:
        return None  # nothing prefilled: the general path starts the state
    # Each weight is looked up once (a step runs this for every KDA layer: lookups cost as much as math here).
    w_q, w_k, w_v, w_fa, w_fb, w_b, o_norm, w_o = _weights(
        kda, "q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "o_norm", "o_proj"
    )
    convs = _weights(kda, "q_conv1d", "k_conv1d", "v_conv1d")  # [P, 1, ks] each
    w_gate, w_gate_b = (
        (_weight(kda, "g_proj"), None) if kda.full_rank_gate else _weights(kda, "g_a_proj", "g_b_proj")
    )
    norm_w, a_log, dt_bias = parameter(norm, "weight"), parameter(kda, "A_log"), parameter(kda, "dt_bias")
    native = _native(
        x, [norm_w, w_q, w_k, w_v, *convs, w_fa, w_fb, a_log, dt_bias, w_b, w_gate, w_gate_b, o_norm, w_o]
    )
    if native is None:
        return None
    update, state.conv_q, state.conv_k, state.conv_v, state.recurrent = native.kda_mixer(
        x.contiguous(),  # [B, 1, hidden]; the kernels take the model's shapes as they are
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
        state.conv_q.contiguous(),
        state.conv_k.contiguous(),
        state.conv_v.contiguous(),
        state.recurrent.contiguous(),  # updated in place (and returned)
        kda.l2norm_eps,
        kda.head_dim**-0.5,
    )
    return update


def mla_update(norm: RMSNorm, mla: MLAttention, x: torch.Tensor, state: MLAState) -> torch.Tensor | None:
    if state.latent is None or state.k_rope is None or state.latent.dtype != torch.float32:
        return None  # nothing prefilled (the general path allocates the cache) or another cache dtype
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
    native = _native(x, [norm_w, w_q, q_norm, w_q_b, w_kv_a, kv_norm, w_kv_b, w_g, w_o])
    if native is None:
        return None
    state.reserve(1)
    update = native.mla_mixer(
        x.contiguous(),
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
        state.latent,
        state.k_rope,
        state.lengths,
        mla.num_heads,
        mla.nope,
        mla.rope,
        mla.v_dim,
        mla.scale,
    )  # wrote each row's latent at its position lengths[b]
    state.lengths = state.lengths + 1
    return update


def ffn_update(norm: RMSNorm, ffn: MLP | MoE, y: torch.Tensor) -> torch.Tensor | None:
    """ffn(norm(y)) for y [B, 1, hidden]; None: take the general path."""
    if ffn.situ is not None and ffn.situ[1] is None:  # an uncapped SiTU: the kernels cap the up projection
        return None
    if isinstance(ffn, MLP):
        return mlp_update(norm, ffn, y)
    return moe_update(norm, ffn, y) if isinstance(ffn, MoE) else None


def mlp_update(norm: RMSNorm, mlp: MLP, y: torch.Tensor) -> torch.Tensor | None:
    norm_w = parameter(norm, "weight")
    matrices = _weights(mlp, "gate_proj", "up_proj", "down_proj")
    native = _native(y, [norm_w, *matrices])
    if native is None:
        return None
    return native.mlp(y.contiguous(), _f32(norm_w), norm.eps, *matrices, *native_activation(mlp.situ))


def moe_update(norm: RMSNorm, moe: MoE, y: torch.Tensor) -> torch.Tensor | None:
    router = child(moe, "gate")
    if router._forward_hooks or router._forward_pre_hooks:  # recorded or replayed routing: its own forward
        return None
    if "dispatch" in moe.__dict__:  # a dispatch of its own (k3.dist's expert parallelism): the general path
        return None
    dense_parts = _dense_parts(moe)
    if dense_parts is None:  # MXFP4 latent projections or shared experts: the kernel takes plain ones
        return None
    down, up, shared = dense_parts
    latent_norm = child(moe, "routed_expert_norm") if moe.latent_norm else None
    latent_norm_w = None if latent_norm is None else parameter(latent_norm, "weight")
    norm_w = parameter(norm, "weight")
    router_w, bias = parameter(router, "weight"), parameter(router, "e_score_correction_bias")
    native = _native(y, [norm_w, router_w, bias, down, up, *shared, latent_norm_w])
    if native is None:
        return None
    xn, z, mixing, indices = native.moe_route(
        y.contiguous(),
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
    if moe.load_experts is not None:  # k3.model.on_demand: read the chosen experts not read yet
        moe.load_experts(indices)
    chosen = [e for row in indices.tolist() for e in row]  # [B * k], row-major
    distinct = list(dict.fromkeys(chosen))  # each chosen expert once, in order of first choice
    slot = {e: i for i, e in enumerate(distinct)}
    experts = child(moe, "experts")._modules  # {"0": RoutedExpert, ...}: cheaper than ModuleList indexing
    found = native_expert_weights([experts[str(e)] for e in distinct])  # type: ignore[misc]
    if found is None:  # mixed kinds, or some experts exact and some approximate: each its own forward
        return None
    return native.moe_experts(
        xn,
        z,
        mixing,
        [slot[e] for e in chosen],  # row-major [B, k]: each pair's position in `distinct`
        found.dense,
        found.packed,
        found.scale,
        *native_activation(moe.situ),
        None if latent_norm_w is None else _f32(latent_norm_w),
        0.0 if latent_norm is None else latent_norm.eps,
        up,
        *shared,
        int8_x=found.int8_x,
    )


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


def lm_head_logits(lm_head: Linear, h: torch.Tensor) -> torch.Tensor | None:
    """lm_head(h) for h [B, 1, hidden] in one native call (its rows split across threads); None: general."""
    weight = parameter(lm_head, "weight")
    native = _native(h, [weight])
    if native is None:
        return None
    x = h.contiguous()  # [B, 1, hidden]; h may be the last position of a longer prefill
    return native.project(x, None, 0.0, [weight])[0]
