"""One decode token of a KDA layer after its projections: the short convs, the L2 norms, the state step.

    q, k, v = silu(conv([tail; x]))     depthwise, width ks, over the tail (last ks-1 inputs) and x
    o, S'   = recurrent_kda_step(l2(q), l2(k), v, g, beta, S)

Inputs: x_q, x_k [B, H*K], x_v [B, H*V] (the q/k/v projections of one token per sequence), tails
[B, ks-1, channels] each, conv weights [channels, ks] each, g [B, H, K] (log-decay), beta [B, H], the
state [B, H, K, V] fp32. Returns ``(o [B, H, V], (new tails), new state)``; the inputs are not modified.

The native kernel (``decode_step`` in ``_native_decode.h``) does it all in one call, where torch takes
about a hundred small ops; :func:`kda_decode_step_torch` is the same in torch (reference and fallback).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.kda.inputs import default_scale
from k3.ops.kda.native import load_native
from k3.ops.kda.recurrent import recurrent_kda_step

Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _conv_step(
    x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, C], tail [B, ks-1, C], weight [C, ks] -> (silu(conv) [B, C], new tail [B, ks-1, C])."""
    full = torch.cat([tail, x[:, None]], dim=1)  # [B, ks, C]
    y = full[:, 0] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        y = y + full[:, j] * weight[:, j]
    return F.silu(y), full[:, 1:]


def kda_decode_step_torch(
    x: Triple,
    tails: Triple,
    conv_weights: Triple,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, Triple, torch.Tensor]:
    """The decode step in torch ops (see the module docstring for the shapes)."""
    B, H, K, V = state.shape
    (q, tail_q), (k, tail_k), (v, tail_v) = (
        _conv_step(xi, ti, wi) for xi, ti, wi in zip(x, tails, conv_weights, strict=True)
    )
    o, new_state = recurrent_kda_step(
        q.view(B, 1, H, K),
        k.view(B, 1, H, K),
        v.view(B, 1, H, V),
        g.view(B, 1, H, K),
        beta.view(B, 1, H),
        scale=scale,
        initial_state=state,
        use_qk_l2norm=True,
    )
    return o.view(B, H, V), (tail_q, tail_k, tail_v), new_state  # type: ignore[return-value]


def kda_decode_step(
    x: Triple,
    tails: Triple,
    conv_weights: Triple,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, Triple, torch.Tensor]:
    """The decode step: the native kernel for fp32 CPU tensors where it is built, else torch."""
    tensors = (*x, *tails, *conv_weights, g, beta, state)
    native = (
        load_native() if all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) else None
    )
    if native is None:
        return kda_decode_step_torch(x, tails, conv_weights, g, beta, state, scale)
    o, tail_q, tail_k, tail_v, new_state = native.decode_step(
        *(t.contiguous() for t in tensors), default_scale(scale, state.shape[2])
    )
    return o, (tail_q, tail_k, tail_v), new_state
