"""KDA decode step: advance a state by a few tokens (T = 1 in generation).

Same recurrence as ``naive.py``, rearranged so that each token reads the state once and writes it
once (the state is [B, H, K, V] fp32, 6.3 MB per K3 layer, so passes over it are what costs):

    [k~; q~] = [k; q] * exp(g)                 # decay folded into the query and key
    [kS; qS] = [k~; q~] S                      # one batched matvec: k^T D S and q^T D S
    u        = beta (v - kS)
    o        = qS + (q . k) u                  # q^T (D S + k u^T)
    S       <- D S + k u^T                     # one scaled copy, then one rank-1 update in place
"""

from __future__ import annotations

import torch

from k3.ops.kda.inputs import DEFAULT_L2NORM_EPS, check_inputs, prepare_inputs


def recurrent_kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    use_qk_l2norm: bool = False,
    l2norm_eps: float = DEFAULT_L2NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run T (few) tokens from ``initial_state`` [B, H, K, V]; returns ``(o [B, T, H, V], new state)``.

    The input state is never modified; the returned one is a new fp32 tensor.
    """
    B, T, H, K, V = check_inputs(q, k, v, g, beta, initial_state)
    in_dtype = q.dtype
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm, l2norm_eps)
    if initial_state is None:
        state = q.new_zeros(B * H, K, V)
    else:
        state = initial_state.to(q.dtype).reshape(B * H, K, V)

    decay = g.exp()  # [B, T, H, K]
    readers = torch.stack([k * decay, q * decay], dim=3).reshape(B, T, H, 2, K)  # [k~; q~] per token
    qk = (q * k).sum(-1, keepdim=True)  # [B, T, H, 1]
    outputs = []
    for t in range(T):
        read = torch.bmm(readers[:, t].reshape(B * H, 2, K), state)  # [B*H, 2, V]: kS, qS
        u = beta[:, t].reshape(B * H, 1) * (v[:, t].reshape(B * H, V) - read[:, 0])  # [B*H, V]
        outputs.append(read[:, 1] + qk[:, t].reshape(B * H, 1) * u)
        state = state * decay[:, t].reshape(B * H, K, 1)
        state = state.baddbmm_(k[:, t].reshape(B * H, K, 1), u.unsqueeze(1))
    o = torch.stack(outputs, dim=1).view(B, H, T, V).transpose(1, 2) if T else v.new_zeros(B, 0, H, V)
    return o.to(in_dtype), (state.view(B, H, K, V) if output_final_state else None)
