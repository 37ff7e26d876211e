"""Chunkwise Kimi Delta Attention: the fast path for prefill and training (forward + autograd).

Same recurrence as ``naive.py``. Within a chunk of C tokens starting from state S0, with
``G_i`` the in-chunk cumulative log-decay (inclusive) and ``Gamma_i = exp(G_i)`` (per channel),
the state after token t is ``Gamma_t S0 + sum_{j<=t} (Gamma_t / Gamma_j) k_j u_j^T`` where the
"pseudo values" u solve a unit lower-triangular system (the WY / UT form):

    (I + A) u = diag(beta) (v - (k Gamma) S0),   A_ij = beta_i k_i^T diag(Gamma_i / Gamma_j) k_j  (j < i)
    o = (q Gamma) S0 + P u,                      P_ij = q_i^T diag(Gamma_i / Gamma_j) k_j         (j <= i)
    S_C = Gamma_C S0 + (k Gamma_C / Gamma)^T u

So per chunk: W = (I + A)^-1 diag(beta) k Gamma and U = (I + A)^-1 diag(beta) v, all chunks at
once; then one loop over chunks, ``u = U - W S``, ``o = (q Gamma) S + P u``, ``S <- Gamma_C S + K^T u``.

**Safe decay products.** ``Gamma_i / Gamma_j`` per channel would be a [C, C, K] tensor. Instead
each chunk is cut into sub-blocks of s tokens, and with ``Gl`` the log-decay relative to the
first token of the sub-block (so ``-(s-1) * |min g| <= Gl <= 0``):

    Gamma_i / Gamma_j = exp(Gl_i) * exp(G_first(a) - G_first(b)) * exp(-Gl_j)    (i in block a, j in b <= a)

The middle factor is a per-(a, b) [K] vector <= 1, so A and P become plain batched matmuls of
``[q; k] * exp(Gl)`` with ``k * exp(-Gl) * pair(a, b)``. The only large number is ``exp(-Gl)``,
bounded by ``exp((s-1) |min g|)``: s is chosen per call as the largest power of two with
``(s-1) |min g| <= 80`` (fp32 holds e^88). K3's gate has g > -5 per step, so s = 16; a gate near 0
gives s = C (one block); a huge softplus gate (say -50 per step) gives s = 2 and, beyond -80 per
step, s = 1, where the blocks degenerate to the exact per-pair decays: always finite, never
``exp(+large)``. Only one exponential per element is taken (``exp(Gl)``, whose argument stays
above -80: exp of values below about -87 is ~50x slower on x86) plus exp(-Gl).

**Cache tiling.** The parallel part runs on tiles of a few chunk steps, each followed by its part
of the sequential loop, so intermediates stay in cache: on CPU an elementwise pass over a large
fresh tensor costs more than the matmuls it feeds.

Gradients come from autograd through this form (loop over chunks, not tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.kda.inputs import check_inputs, compute_dtype, default_scale, l2norm
from k3.ops.kda.layout import ChunkLayout

EXP_LIMIT = 80.0  # largest exponent taken inside a sub-block; fp32 overflows at ~88.7
TILE_CHUNK_HEADS = 64  # chunks x sequences x heads processed per tile (sets the cache footprint)
INVERSE_BASE = 16  # unit-triangular blocks up to this size are inverted by one batched solve


def sub_block_size(g_min: float, chunk_size: int) -> int:
    """Largest power of two s <= chunk_size with (s - 1) * |g_min| <= EXP_LIMIT."""
    s = chunk_size
    while s > 1 and (s - 1) * -g_min > EXP_LIMIT:
        s //= 2
    return s


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + a)^-1 for strictly lower-triangular a [Z, C, C], by 2x2 block recursion.

    ``[[I+a11, 0], [a21, I+a22]]^-1 = [[x11, 0], [-x22 a21 x11, x22]]``; both halves recurse as one
    batch and the base blocks go to one batched triangular solve (faster than solving C x C).
    """
    Z, C, _ = a.shape
    if C <= INVERSE_BASE or C % 2:
        eye = torch.eye(C, dtype=a.dtype, device=a.device).expand(Z, C, C)
        return torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
    h = C // 2
    halves = unit_lower_inverse(torch.cat([a[:, :h, :h], a[:, h:, h:]]))  # [2Z, h, h]
    x11, x22 = halves[:Z], halves[Z:]
    x21 = -torch.bmm(x22, torch.bmm(a[:, h:, :h], x11))
    top = torch.cat([x11, x11.new_zeros(Z, h, h)], dim=2)
    return torch.cat([top, torch.cat([x21, x22], dim=2)], dim=1)


def _intra_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s: int
) -> tuple[torch.Tensor, ...]:
    """Everything that does not depend on the state, for Z chunks at once.

    q, k, g: [Z, C, K]; v: [Z, C, V]; beta: [Z, C]; s: sub-block size (divides C).
    Returns W [Z, C, K] and q Gamma [Z, C, K] stacked as WQ [Z, 2C, K], U [Z, C, V],
    P [Z, C, C], K_hat = k Gamma_C / Gamma [Z, C, K], Gamma_C [Z, K].
    """
    Z, C, K = k.shape
    n = C // s
    g = g.view(Z, n, s, K)
    # Every log-decay below is a direct sum of same-sign terms (g <= 0), never a difference of two
    # long prefix sums: that difference would lose |prefix| * eps of absolute precision.
    local = F.pad(g[:, :, 1:].cumsum(dim=2), (0, 0, 1, 0))  # Gl [Z, n, s, K]: sum over (first_b, j]
    head = g[:, :, 0]  # g of each block's first token [Z, n, K]
    rest = local[:, :, -1]  # sum over the block after its first token [Z, n, K]
    totals = head + rest  # [Z, n, K]
    first = F.pad(totals[:, :-1].cumsum(dim=1), (0, 0, 1, 0)) + head  # G at each block's first token
    after = F.pad(totals[:, 1:].flip(1).cumsum(dim=1).flip(1), (0, 0, 0, 1))  # sum over later blocks
    chunk_total = totals.sum(dim=1)  # G_C [Z, K]

    decay_in = local.exp()  # exp(Gl) in [e^-EXP_LIMIT, 1]
    decay_out = (-local).exp()  # exp(-Gl) in [1, e^EXP_LIMIT]
    q4, k4 = q.view(Z, n, s, K), k.view(Z, n, s, K)
    left = torch.cat([q4 * decay_in, k4 * decay_in], dim=2)  # [Z, n, 2s, K]: rows of P, then of A
    k_out = k4 * decay_out  # [Z, n, s, K]
    if n == 1:
        right = k_out  # [Z, 1, C, K]
    else:
        # gap[a, b] = G_first(a) - G_first(b) = sum of the steps first(b') - first(b'-1), b < b' <= a
        steps = rest[:, :-1] + head[:, 1:]  # [Z, n - 1, K], step b' = 1 .. n-1
        after_b = torch.ones(n - 1, n, dtype=torch.bool, device=g.device).tril().view(1, n - 1, n, 1)
        gap = F.pad((steps.unsqueeze(2) * after_b).cumsum(dim=1), (0, 0, 0, 0, 1, 0))  # [Z, n(a), n(b), K]
        later = torch.ones(n, n, dtype=torch.bool, device=g.device).triu(1).view(1, n, n, 1)
        pair = gap.masked_fill(later, float("-inf")).exp()  # exp(gap) for b <= a, 0 above
        right = (k_out.unsqueeze(1) * pair.unsqueeze(3)).view(Z, n, C, K)  # [Z, n(a), C, K]
    scores = torch.matmul(left, right.transpose(-1, -2))  # [Z, n, 2s, C]
    p = scores[:, :, :s].reshape(Z, C, C).tril()
    a = scores[:, :, s:].reshape(Z, C, C).tril(-1) * beta.unsqueeze(-1)

    first_decay = first.exp().unsqueeze(2)  # Gamma at each block's first token [Z, n, 1, K]
    q_gamma = (left[:, :, :s] * first_decay).view(Z, C, K)  # q Gamma
    k_gamma = (left[:, :, s:] * first_decay).view(Z, C, K)  # k Gamma
    # Gamma_C / Gamma_j = exp(-Gl_j) * exp(rest_b + after_b)
    k_hat = (k_out * (rest + after).exp().unsqueeze(2)).view(Z, C, K)
    inverse = unit_lower_inverse(a)  # (I + A)^-1 [Z, C, C]
    beta = beta.unsqueeze(-1)
    w = torch.bmm(inverse, k_gamma * beta)
    u = torch.bmm(inverse, v * beta)
    return torch.cat([w, q_gamma], dim=1), u, p, k_hat, chunk_total.exp()


def chunk_kda(
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
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA, equal to ``naive_recurrent_kda`` up to rounding; differentiable.

    q, k, g: [B, T, H, K] (g <= 0); v: [B, T, H, V]; beta: [B, T, H]. With ``cu_seqlens``
    ([N + 1] boundaries of N packed sequences), B must be 1 and states are per sequence:
    initial_state [N, H, K, V], final state [N, H, K, V]. ``chunk_size`` must be a power of two.
    Returns ``(o [B, T, H, V] in q's dtype, final state fp32 or None)``.
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed into B = 1, got B = {q.shape[0]}")
    num_seqs = None if cu_seqlens is None else cu_seqlens.numel() - 1
    B, T, H, K, V = check_inputs(q, k, v, g, beta, initial_state, num_seqs)
    in_dtype, dtype = q.dtype, compute_dtype(q)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if T > 0:
        g_min, g_max = (x.item() for x in torch.aminmax(g.detach()))
        if g_max > 0:
            raise ValueError(f"g is a log-decay and must be <= 0, got max {g_max}")
    else:
        g_min = 0.0
    s = sub_block_size(g_min, chunk_size)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * default_scale(scale, K)

    layout = (
        ChunkLayout.dense(B, T, chunk_size)
        if cu_seqlens is None
        else ChunkLayout.packed(cu_seqlens, T, chunk_size)
    )
    q, k, v, g, beta = (layout.to_chunks(x) for x in (q, k, v, g, beta))  # [steps, N, H, C, *]
    N, C = layout.num_seqs, chunk_size
    state = (
        q.new_zeros(N * H, K, V) if initial_state is None else initial_state.to(dtype).reshape(N * H, K, V)
    )
    tile = max(1, TILE_CHUNK_HEADS // (N * H))
    outputs = []
    for t0 in range(0, layout.steps, tile):
        t1 = min(t0 + tile, layout.steps)
        Z = (t1 - t0) * N * H
        wq, u_all, p, k_hat, chunk_decay = _intra_chunk(
            q[t0:t1].reshape(Z, C, K),
            k[t0:t1].reshape(Z, C, K),
            v[t0:t1].reshape(Z, C, V),
            g[t0:t1].reshape(Z, C, K),
            beta[t0:t1].reshape(Z, C),
            s,
        )
        shape = (t1 - t0, N * H)
        wq, u_all, p = wq.view(*shape, 2 * C, K), u_all.view(*shape, C, V), p.view(*shape, C, C)
        k_hat, chunk_decay = k_hat.view(*shape, C, K), chunk_decay.view(*shape, K, 1)
        for i in range(t1 - t0):
            from_state = torch.bmm(wq[i], state)  # [N*H, 2C, V]: W S and (q Gamma) S
            u = u_all[i] - from_state[:, :C]  # pseudo values [N*H, C, V]
            outputs.append(torch.baddbmm(from_state[:, C:], p[i], u))
            state = torch.baddbmm(state * chunk_decay[i], k_hat[i].transpose(1, 2), u)
    o = torch.stack(outputs).view(layout.steps, N, H, C, V) if outputs else v.new_zeros(0, N, H, C, V)
    o = layout.to_tokens(o).to(in_dtype)
    final = state.view(N, H, K, V) if output_final_state else None
    return o, final
