"""Chunkwise Kimi Delta Attention: the fast path for prefill and training (forward + gradients).

Same recurrence as ``naive.py``. Within a chunk of C tokens starting from state S0, with
``G_i`` the in-chunk cumulative log-decay (inclusive) and ``Gamma_i = exp(G_i)`` (per channel),
the state after token t is ``Gamma_t S0 + sum_{j<=t} (Gamma_t / Gamma_j) k_j u_j^T`` where the
"pseudo values" u solve a unit lower-triangular system (the WY / UT form):

    (I + A) u = diag(beta) (v - (k Gamma) S0),   A_ij = beta_i k_i^T diag(Gamma_i / Gamma_j) k_j  (j < i)
    o = (q Gamma) S0 + P u,                      P_ij = q_i^T diag(Gamma_i / Gamma_j) k_j         (j <= i)
    S_C = Gamma_C S0 + (k Gamma_C / Gamma)^T u

So, for all chunks at once: ``W = (I + A)^-1 diag(beta) k Gamma`` and ``U = (I + A)^-1 diag(beta) v``
(one batched triangular solve), P, ``q Gamma``, ``K_hat = k Gamma_C / Gamma``. Then the only
sequential part, one loop over chunks (``state_passing.py``, in C++ where built; three products each):

    qS = (q Gamma) S;  u = U - W S;  S <- Gamma_C S + K_hat^T u

and afterwards, for all chunks at once again, ``o = qS + P u``.

**Safe decays: base chunks, then merges.** ``Gamma_i / Gamma_j`` per channel would be a [C, C, K]
tensor. Instead A and P are plain matmuls of ``[q; k] * exp(G)`` with ``k * exp(-G)``, which is
exact as long as ``exp(-G)`` stays finite; with G taken from the chunk's first token,
``-G <= (s - 1) |min g|`` over s tokens. So the terms above are first built for base chunks of s
tokens, s the largest power of two <= C with ``(s - 1) |min g| <= 80`` (fp32 holds e^88): K3's gate
has g > -5 per step, so s = 16; a gate near 0 gives s = C; a huge softplus gate gives a smaller s,
down to single tokens (where the exponent is 0). Then adjacent chunks a, b merge into one
of twice the length with only products of decays (factors <= 1), never ``exp(+large)``:

    M = [q Gamma; W]_b K_hat_a^T                  (the b rows' view of what a wrote)
    q Gamma' = [q Gamma_a; q Gamma_b Gamma_Ca]    W' = [W_a; W_b Gamma_Ca - M_w W_a]
    U' = [U_a; U_b - M_w U_a]                     P' = [[P_a, 0], [M_q, P_b]]
    K_hat' = [K_hat_a Gamma_Cb; K_hat_b]          Gamma_C' = Gamma_Ca Gamma_Cb

(from ``S_b = Gamma_Ca S_a + K_hat_a^T u_a`` substituted into chunk b's reads and writes).

**Cache tiling.** The parallel part runs on tiles of a few chunk steps, each followed by its part
of the sequential loop, so intermediates stay in cache: on CPU an elementwise pass over a large
fresh tensor costs more than the matmuls it feeds.

**Chunk size.** 16 by default: with K3's gate that is exactly one base chunk, and it does the
fewest flops. On the 2-core dev box (B=1, H=8, K=V=128, T=4096, fp32, torch path) chunk sizes
16 / 32 / 64 ran forward in 0.082 / 0.091 / 0.107 s and forward+backward in 0.32 / 0.32 / 0.33 s.

**Two implementations.** This file, in torch: any dtype, device, gate and chunk size; gradients by
autograd through the parallel parts and the hand-written adjoint of ``StatePassing`` for the loop
(its two loops in C++ where built). And, for fp32 on CPU when one base chunk is the whole chunk
(K3's gate at C = 16), ``fused.py``: the same arithmetic per chunk in two native calls, forward and
backward, from the token layout to the token layout (~2x faster forward, ~2.2x forward+backward;
benchmarks/kda.py). The tests hold each against this one and this one against ``naive.py``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from k3.ops.kda.fused import fused_chunk_kda
from k3.ops.kda.inputs import DEFAULT_L2NORM_EPS, check_inputs, compute_dtype, default_scale
from k3.ops.kda.layout import ChunkLayout
from k3.ops.kda.native import load_native
from k3.ops.kda.state_passing import StatePassing

EXP_LIMIT = 80.0  # largest exponent taken inside a base chunk; fp32 overflows at ~88.7
BASE_CHUNK = 16  # base chunks are at most this long; longer chunks are built by merges
TILE_CHUNK_HEADS = 64  # chunks x sequences x heads processed per tile (sets the cache footprint)


def g_floor(chunk_size: int) -> float:
    """The lowest g one base chunk of ``chunk_size`` tokens takes: (chunk_size - 1) |g| <= EXP_LIMIT."""
    return -EXP_LIMIT / (chunk_size - 1) if chunk_size > 1 else -math.inf


def base_chunk_size(g_min: float, chunk_size: int) -> int:
    """Largest power of two s <= chunk_size with g_min >= g_floor(s)."""
    s = chunk_size
    while s > 1 and g_min < g_floor(s):
        s //= 2
    return s


class _ExpBothWays(torch.autograd.Function):
    """``(exp(x), exp(-x))`` with one exponential; for x in [-EXP_LIMIT, 0] both stay finite.

    Plain ``1 / exp(x)`` would work forward, but its autograd formula squares the reciprocal
    (up to e^160, inf in fp32); this backward uses ``d/dx = g1 exp(x) - g2 exp(-x)`` instead.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        down = x.exp()
        up = down.reciprocal()
        ctx.save_for_backward(down, up)
        return down, up

    @staticmethod
    def backward(ctx, grad_down: torch.Tensor, grad_up: torch.Tensor) -> torch.Tensor:
        down, up = ctx.saved_tensors
        return grad_down * down - grad_up * up


class ChunkTerms(NamedTuple):
    """Everything about Z chunks of c tokens that does not depend on the state."""

    q_gamma: torch.Tensor  # q Gamma [Z, c, K]
    w: torch.Tensor  # W = (I + A)^-1 diag(beta) k Gamma [Z, c, K]
    u: torch.Tensor  # U = (I + A)^-1 diag(beta) v [Z, c, V]
    p: torch.Tensor  # P, lower triangle with diagonal [Z, c, c]
    k_hat: torch.Tensor  # k Gamma_C / Gamma [Z, c, K]
    decay: torch.Tensor  # Gamma_C [Z, 1, K]


def base_terms(qk: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> ChunkTerms:
    """The terms of Z base chunks of s tokens, with (s - 1) |min g| <= EXP_LIMIT.

    qk: [Z, 2, s, K] (q rows then k rows); v: [Z, s, V]; g: [Z, s, K]; beta: [Z, s].
    """
    Z, _, s, K = qk.shape
    G = g.cumsum(dim=1)  # [Z, s, K]
    # decays relative to the first token: Gl = G - g_0 in [-EXP_LIMIT, 0] (exactly 0 when s = 1)
    local = G - g[:, :1]
    down, up = _ExpBothWays.apply(local)  # exp(Gl) in [e^-80, 1], exp(-Gl) in [1, e^80]
    left = qk * down.unsqueeze(1)  # [Z, 2, s, K]
    k_over = qk[:, 1] * up  # [Z, s, K]
    scores = torch.bmm(left.view(Z, 2 * s, K), k_over.transpose(1, 2))  # [Z, 2s, s]
    # above the diagonal scores hold exp(G_i - G_j) > 1 (finite); tril drops them (no 0 * big)
    p = scores[:, :s].tril()
    a = scores[:, s:].tril(-1) * beta.unsqueeze(-1)  # A, strictly lower, times beta_i
    decay = G[:, -1:].exp()  # Gamma_C [Z, 1, K]
    first = g[:, :1].exp()  # Gamma_0 [Z, 1, K]: the decays above were relative to it
    q_gamma, k_gamma = left[:, 0] * first, left[:, 1] * first  # q Gamma, k Gamma [Z, s, K]
    # (I + A)^-1 against the identity, then two matmuls: batched LAPACK solves against wide
    # right-hand sides are several times slower on CPU
    eye = torch.eye(s, dtype=g.dtype, device=g.device).expand(Z, s, s)
    solve = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True) * beta.unsqueeze(-2)
    w, u = torch.bmm(solve, k_gamma), torch.bmm(solve, v)
    return ChunkTerms(q_gamma, w, u, p, k_over * local[:, -1:].exp(), decay)


def merge_pairs(t: ChunkTerms) -> ChunkTerms:
    """Chunks (2i, 2i + 1) of every group of m -> one chunk: [Z * m, c, *] -> [Z * m / 2, 2c, *].

    A pair is already one merged chunk in memory ([Z', 2, c, *] viewed as [Z', 2c, *]), so the merge is
    a per-half scaling and, for W and U, the block transform ``[[I, 0], [-M_w, I]]``: no large copies.
    """
    Z2, c, K = t.q_gamma.shape[0] // 2, t.q_gamma.shape[1], t.q_gamma.shape[2]
    q_gamma, w, k_hat = (x.view(Z2, 2, c, K) for x in (t.q_gamma, t.w, t.k_hat))
    decay_a, decay_b = t.decay.view(Z2, 2, 1, K).unbind(1)  # [Z', 1, K]
    ones = torch.ones_like(decay_a)
    k_hat_a = k_hat[:, 0].transpose(1, 2)  # [Z', K, c]
    m_q = torch.bmm(q_gamma[:, 1], k_hat_a)  # [Z', c, c]: what b's queries read of a's writes
    m_w = torch.bmm(w[:, 1], k_hat_a)
    top = F.pad(t.p.view(Z2, 2, c, c)[:, 0], (0, c))  # [P_a, 0]
    p = torch.cat([top, torch.cat([m_q, t.p.view(Z2, 2, c, c)[:, 1]], dim=2)], dim=1)
    eye = torch.eye(2 * c, dtype=m_w.dtype, device=m_w.device)
    transform = eye - F.pad(m_w, (0, c, c, 0))  # [[I, 0], [-M_w, I]] [Z', 2c, 2c]
    w_scaled = (w * torch.stack([ones, decay_a], dim=1)).view(Z2, 2 * c, K)
    return ChunkTerms(
        (q_gamma * torch.stack([ones, decay_a], dim=1)).view(Z2, 2 * c, K),
        torch.bmm(transform, w_scaled),
        torch.bmm(transform, t.u.view(Z2, 2 * c, -1)),
        p,
        (k_hat * torch.stack([decay_b, ones], dim=1)).view(Z2, 2 * c, K),
        decay_a * decay_b,
    )


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
    l2norm_eps: float = DEFAULT_L2NORM_EPS,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 16,
    keep_states: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA, equal to ``naive_recurrent_kda`` up to rounding; differentiable.

    q, k, g: [B, T, H, K] (g <= 0); v: [B, T, H, V]; beta: [B, T, H]. With ``cu_seqlens``
    ([N + 1] boundaries of N packed sequences), B must be 1 and states are per sequence:
    initial_state [N, H, K, V], final state [N, H, K, V]. ``chunk_size`` must be a power of two.
    ``use_qk_l2norm`` divides q and k by ``sqrt(sum(x^2) + l2norm_eps)`` first.
    ``keep_states=False`` trades backward time for memory on the fused path: its forward then keeps
    no chunk-start states for the backward (see ``fused.py``).
    Returns ``(o [B, T, H, V] in q's dtype, final state fp32 or None)``.
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed into B = 1, got B = {q.shape[0]}")
    num_seqs = None if cu_seqlens is None else cu_seqlens.numel() - 1
    B, T, H, K, V = check_inputs(q, k, v, g, beta, initial_state, num_seqs)
    in_dtype, dtype = q.dtype, compute_dtype(q)
    # the native kernels where built (fp32 on CPU): the fused forward and backward when one base chunk
    # is the whole chunk, else the state loop only
    native = load_native() if dtype == torch.float32 and q.device.type == "cpu" else None
    if native is not None and chunk_size <= BASE_CHUNK and T > 0:
        # the fused forward checks g's range as it reads each chunk (a pass of its own over g cost 2 % of
        # it) and refuses, having stopped there, a g that one base chunk cannot take: the path below then
        # checks g and runs smaller base chunks
        args = (initial_state, cu_seqlens, chunk_size, g_floor(chunk_size), scale, use_qk_l2norm, l2norm_eps)
        try:
            o, final = fused_chunk_kda(native, q, k, v, g, beta, *args, keep_states)
        except native.GateOutOfRange:
            pass
        else:
            return o.to(in_dtype), final if output_final_state else None
    if T > 0:
        g_min, g_max = (x.item() for x in torch.aminmax(g.detach()))
        if g_max > 0:
            raise ValueError(f"g is a log-decay and must be <= 0, got max {g_max}")
    else:
        g_min = 0.0
    s = base_chunk_size(g_min, min(chunk_size, BASE_CHUNK))
    # q gets the scale; with the L2 norm it is folded into the normalising factor
    qk_scale = torch.tensor([default_scale(scale, K), 1.0], dtype=dtype).view(2, 1, 1)

    layout = (
        ChunkLayout.dense(B, T, chunk_size)
        if cu_seqlens is None
        else ChunkLayout.packed(cu_seqlens, T, chunk_size)
    )
    # token layout -> [steps, N, H, C, *] (views for dense inputs; each tile is copied once below)
    q, k, v, g, beta = (layout.to_chunks(x) for x in (q, k, v, g, beta))
    N, C = layout.num_seqs, chunk_size
    if initial_state is None:
        state = torch.zeros(N * H, K, V, dtype=dtype, device=q.device)
    else:
        state = initial_state.to(dtype).reshape(N * H, K, V)
    tile = max(1, TILE_CHUNK_HEADS // (N * H))
    outputs = []
    # tiles by split, not slicing: a slice's backward writes into zeros the size of the whole input
    tiles = zip(*(x.split(tile) for x in (q, k, v, g, beta)), strict=True)
    for q_t, k_t, v_t, g_t, beta_t in tiles:
        Z = q_t.shape[0] * N * H
        # [t, N, H, C / s, 2, s, K] -> [Z * C / s, 2, s, K]: one copy (and dtype cast) for q and k
        by_base = (x.unflatten(3, (C // s, s)) for x in (q_t, k_t))
        qk = torch.stack(list(by_base), dim=4).to(dtype).view(-1, 2, s, K)
        if use_qk_l2norm:
            norm = torch.linalg.vector_norm(qk, dim=-1, keepdim=True)
            qk = qk * (qk_scale / torch.sqrt(norm * norm + l2norm_eps))
        else:
            qk = qk * qk_scale
        terms = base_terms(
            qk,
            v_t.reshape(-1, s, V).to(dtype),
            g_t.reshape(-1, s, K).to(dtype),
            beta_t.reshape(-1, s).to(dtype),
        )
        while terms.q_gamma.shape[1] < C:
            terms = merge_pairs(terms)
        t = Z // (N * H)
        reads, u, state = StatePassing.apply(
            terms.q_gamma.view(t, N * H, C, K),
            terms.w.view(t, N * H, C, K),
            terms.u.view(t, N * H, C, V),
            terms.k_hat.view(t, N * H, C, K),
            terms.decay.view(t, N * H, K),
            state,
            native,
        )
        o_t = torch.baddbmm(reads.view(Z, C, V), terms.p, u.view(Z, C, V))  # (q Gamma) S + P u
        outputs.append(o_t.view(t, N, H, C, V))
    o = torch.cat(outputs) if outputs else v.new_zeros(0, N, H, C, V)
    o = layout.to_tokens(o).to(in_dtype)
    final = state.view(N, H, K, V) if output_final_state else None
    return o, final
