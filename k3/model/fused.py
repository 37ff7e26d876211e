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
from k3.model.moe import MoE
from k3.model.norm import Linear, RMSNorm
from k3.ops.decode.native import load_native
from k3.ops.mxfp4 import MXFP4Linear


def _tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    """`module.<name>` for a parameter or buffer, read from its dicts: a decode step reads ~500 weights, and
    nn.Module.__getattr__ costs ~1 us each (as much as a layer's native call takes to dispatch)."""
    found = module.__dict__["_parameters"].get(name)
    return module.__dict__["_buffers"][name] if found is None else found


def _weight(module: torch.nn.Module, child: str) -> torch.Tensor:
    """`module.<child>.weight`, the same way."""
    return _tensor(module.__dict__["_modules"][child], "weight")


WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def _native(x: torch.Tensor, tensors: list[torch.Tensor | None]) -> ModuleType | None:
    """The kernels, if they may run on x [B, 1, H] and these weights (None entries are absent ones)."""
    if torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if any(t is not None and t.dtype not in WEIGHT_DTYPES for t in tensors):
        return None
    return load_native()


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A small weight (a norm's, a gate's constants, a short convolution) as the kernels take it: fp32."""
    return t if t is None or t.dtype == torch.float32 else t.float()


def _act(situ: tuple[float, float] | None) -> tuple[int, float, float]:
    return (0, 0.0, 0.0) if situ is None else (1, *situ)


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
    low_rank = not kda.full_rank_gate
    w_gate = _weight(kda, "g_a_proj") if low_rank else _weight(kda, "g_proj")
    w_gate_b = _weight(kda, "g_b_proj") if low_rank else None
    convs = (_weight(kda, "q_conv1d"), _weight(kda, "k_conv1d"), _weight(kda, "v_conv1d"))
    weights = [
        _tensor(norm, "weight"),
        _weight(kda, "q_proj"),
        _weight(kda, "k_proj"),
        _weight(kda, "v_proj"),
        *convs,
    ]
    weights += [
        _weight(kda, "f_a_proj"),
        _weight(kda, "f_b_proj"),
        _tensor(kda, "A_log"),
        _tensor(kda, "dt_bias"),
        _weight(kda, "b_proj"),
        w_gate,
    ]
    weights += [w_gate_b, _weight(kda, "o_norm"), _weight(kda, "o_proj")]
    native = _native(x, weights)
    if native is None:
        return None
    update, state.conv_q, state.conv_k, state.conv_v, state.recurrent = native.kda_mixer(
        x.contiguous(),  # [B, 1, hidden]; the kernels take the model's shapes as they are
        _f32(_tensor(norm, "weight")),
        norm.eps,
        _weight(kda, "q_proj"),
        _weight(kda, "k_proj"),
        _weight(kda, "v_proj"),
        *(_f32(w) for w in convs),  # [P, 1, ks]
        _weight(kda, "f_a_proj"),
        _weight(kda, "f_b_proj"),
        _f32(_tensor(kda, "A_log")),
        _f32(_tensor(kda, "dt_bias")),
        kda.lower_bound,  # None: Kimi Linear's softplus gate
        _weight(kda, "b_proj"),
        w_gate,
        w_gate_b,
        _f32(_weight(kda, "o_norm")),
        kda.o_norm.eps,
        _weight(kda, "o_proj"),
        state.conv_q.contiguous(),
        state.conv_k.contiguous(),
        state.conv_v.contiguous(),
        state.recurrent.contiguous(),  # updated in place (and returned)
        kda.l2norm_eps,
        kda.head_dim**-0.5,
    )
    return update


def mla_update(norm: RMSNorm, mla: MLAttention, x: torch.Tensor, state: MLAState) -> torch.Tensor | None:
    w_q = _weight(mla, "q_a_proj") if mla.q_lora else _weight(mla, "q_proj")
    q_norm = _weight(mla, "q_a_layernorm") if mla.q_lora else None
    w_q_b = _weight(mla, "q_b_proj") if mla.q_lora else None
    w_g = _weight(mla, "g_proj") if mla.output_gate else None
    weights = [
        _tensor(norm, "weight"),
        w_q,
        q_norm,
        w_q_b,
        _weight(mla, "kv_a_proj_with_mqa"),
        _weight(mla, "kv_a_layernorm"),
    ]
    weights += [_weight(mla, "kv_b_proj"), w_g, _weight(mla, "o_proj")]
    if state.latent is None or state.k_rope is None or state.latent.dtype != torch.float32:
        return None  # nothing prefilled (the general path allocates the cache) or another cache dtype
    native = _native(x, weights)
    if native is None:
        return None
    state.reserve(1)
    update = native.mla_mixer(
        x.contiguous(),
        _f32(_tensor(norm, "weight")),
        norm.eps,
        w_q,
        _f32(q_norm),
        w_q_b,
        mla.kv_a_layernorm.eps,
        _weight(mla, "kv_a_proj_with_mqa"),
        _f32(_weight(mla, "kv_a_layernorm")),
        _weight(mla, "kv_b_proj"),
        w_g,
        _weight(mla, "o_proj"),
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
    weights = [
        _tensor(norm, "weight"),
        _weight(mlp, "gate_proj"),
        _weight(mlp, "up_proj"),
        _weight(mlp, "down_proj"),
    ]
    native = _native(y, weights)
    if native is None:
        return None
    return native.mlp(y.contiguous(), _f32(weights[0]), norm.eps, *weights[1:], *_act(mlp.situ))


def moe_update(norm: RMSNorm, moe: MoE, y: torch.Tensor) -> torch.Tensor | None:
    router = moe.gate
    if router._forward_hooks or router._forward_pre_hooks:  # recorded or replayed routing: its own forward
        return None
    if "dispatch" in moe.__dict__:  # a dispatch of its own (k3.dist's expert parallelism): the general path
        return None
    if _packed_dense_part(moe):  # MXFP4 latent projections or shared experts: the kernel takes plain ones
        return None
    down = _weight(moe, "routed_expert_down_proj") if moe.latent else None
    up = _weight(moe, "routed_expert_up_proj") if moe.latent else None
    latent_norm = moe.routed_expert_norm if moe.latent_norm else None
    shared = (
        [
            _weight(moe.shared_experts, "gate_proj"),
            _weight(moe.shared_experts, "up_proj"),
            _weight(moe.shared_experts, "down_proj"),
        ]
        if moe.shared
        else [None, None, None]
    )
    weights = [
        _tensor(norm, "weight"),
        _tensor(router, "weight"),
        _tensor(router, "e_score_correction_bias"),
        down,
        up,
        *shared,
    ]
    weights.append(None if latent_norm is None else _tensor(latent_norm, "weight"))
    native = _native(y, weights)
    if native is None:
        return None
    xn, z, mixing, indices = native.moe_route(
        y.contiguous(),
        _f32(_tensor(norm, "weight")),
        norm.eps,
        _tensor(router, "weight"),
        _f32(_tensor(router, "e_score_correction_bias")),
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
    experts = moe.experts._modules  # {"0": RoutedExpert, ...}: ModuleList indexing costs more than the call
    matrices = [experts[str(e)].__dict__["_modules"][w] for e in distinct for w in ("w1", "w3", "w2")]  # type: ignore[union-attr]
    dense: list[torch.Tensor] = []
    packed: list[torch.Tensor] = []
    scale: list[torch.Tensor] = []
    int8_x = False
    if all(isinstance(m, MXFP4Linear) for m in matrices):
        int8 = {m.int8_inputs for m in matrices}  # type: ignore[union-attr]
        if len(int8) > 1:  # some experts exact, some approximate: each its own forward
            return None
        int8_x = int8.pop()
        packed = [_tensor(m, "weight_packed") for m in matrices]
        scale = [_tensor(m, "weight_scale") for m in matrices]
    elif all(isinstance(m, Linear) for m in matrices):
        dense = [_tensor(m, "weight") for m in matrices]
        if any(w.dtype not in WEIGHT_DTYPES for w in dense):
            return None
    else:
        return None
    return native.moe_experts(
        xn,
        z,
        mixing,
        [slot[e] for e in chosen],  # row-major [B, k]: each pair's position in `distinct`
        dense,
        packed,
        scale,
        *_act(moe.situ),
        None if latent_norm is None else _f32(_tensor(latent_norm, "weight")),
        0.0 if latent_norm is None else latent_norm.eps,
        up,
        *shared,
        int8_x=int8_x,
    )


def _packed_dense_part(moe: MoE) -> bool:
    """True when the MoE's latent projections or shared experts are MXFP4 (a checkpoint packed them)."""
    parts = [moe.routed_expert_down_proj, moe.routed_expert_up_proj] if moe.latent else []
    if moe.shared:
        parts += [moe.shared_experts.gate_proj, moe.shared_experts.up_proj, moe.shared_experts.down_proj]
    return any(isinstance(p, MXFP4Linear) for p in parts)


def lm_head_logits(lm_head: Linear, h: torch.Tensor) -> torch.Tensor | None:
    """lm_head(h) for h [B, 1, hidden] in one native call (its rows split across threads); None: general."""
    native = _native(h, [_tensor(lm_head, "weight")])
    if native is None:
        return None
    x = h.contiguous()  # [B, 1, hidden]; h may be the last position of a longer prefill
    return native.project(x, None, 0.0, [_tensor(lm_head, "weight")])[0]
