"""Kimi Delta Attention, one token at a time: the specification every faster form is tested against.

Per head, with a state ``S`` [K, V] (fp32), for each token t:

    S   <- S * exp(g_t)[:, None]                 # per-channel decay of the key rows
    S   <- S + beta_t * k_t (v_t - S^T k_t)^T    # delta rule: move S^T k_t towards v_t
    o_t  = S^T (q_t * scale)

which is ``S = (I - beta k k^T) diag(exp(g)) S + beta k v^T`` (K3.md section 4). This is fla's
``naive_recurrent_kda`` and transformers' ``recurrent_kimi_delta_attention``.
"""

from __future__ import annotations

import torch

from k3.ops.kda.inputs import DEFAULT_L2NORM_EPS, check_inputs, prepare_inputs


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    l2norm_eps: float = DEFAULT_L2NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference KDA: a Python loop over tokens (slow; differentiable by autograd).

    q, k, g: [B, T, H, K] (g is the log-decay, <= 0); v: [B, T, H, V]; beta: [B, T, H];
    initial_state: [B, H, K, V] or None (zeros). Math in fp32 (float64 inputs stay float64).
    Returns ``(o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32 or None)``.
    """
    B, T, H, K, V = check_inputs(q, k, v, g, beta, initial_state)
    in_dtype = q.dtype
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm, l2norm_eps)

    if initial_state is None:
        state = q.new_zeros(B, H, K, V)  # [B, H, K, V]
    else:
        state = initial_state.to(q.dtype)
    outputs = []
    for t in range(T):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]  # [B, H, K], [B, H, K], [B, H, V]
        state = state * g[:, t].exp().unsqueeze(-1)
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)  # S^T k
        delta = beta[:, t].unsqueeze(-1) * (v_t - predicted)  # [B, H, V]
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_t, state))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, V)  # [B, T, H, V]
    return o.to(in_dtype), (state if output_final_state else None)
