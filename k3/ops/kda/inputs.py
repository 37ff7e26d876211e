"""Shared input handling for the KDA ops: shape checks, the compute dtype, L2 normalisation.

Every KDA function takes fla's layout: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
state [N, H, K, V] (N = B, or the number of packed sequences with ``cu_seqlens``).
"""

from __future__ import annotations

import torch

# fla's default (``fla.modules.l2norm.l2norm_fwd``), which every KDA function takes unless told otherwise;
# the model passes ``K3Config.kda_l2norm_eps`` (see docs/epsilons.md).
DEFAULT_L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = DEFAULT_L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and transformers' form, not F.normalize)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for every input dtype except float64, which is kept (used by the gradient tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    num_states: int | None = None,
) -> tuple[int, int, int, int, int]:
    """Validate the shapes of one call and return ``(B, T, H, K, V)``.

    ``num_states`` is the expected leading dim of ``initial_state`` (default B).
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g (log-decay) must have q's shape {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    V = v.shape[-1]
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if initial_state is not None:
        n = B if num_states is None else num_states
        if initial_state.shape != (n, H, K, V):
            raise ValueError(
                f"initial_state must be [N, H, K, V] = [{n}, {H}, {K}, {V}], got {tuple(initial_state.shape)}"
            )
    return B, T, H, K, V


def default_scale(scale: float | None, head_dim: int) -> float:
    return head_dim**-0.5 if scale is None else float(scale)


def prepare_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    use_qk_l2norm: bool,
    l2norm_eps: float = DEFAULT_L2NORM_EPS,
) -> tuple[torch.Tensor, ...]:
    """The five inputs in the compute dtype, q and k L2-normalised (with ``l2norm_eps``) if asked, q times
    the scale.

    Used by the per-token forms (the reference and the decode step); the chunked form folds the same
    steps into its per-tile copy."""
    dtype = compute_dtype(q)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q, l2norm_eps), l2norm(k, l2norm_eps)
    return q * default_scale(scale, q.shape[-1]), k, v, g, beta
