"""Chunkwise Kimi Delta Attention: the fast path for prefill and training (forward + autograd).

Same recurrence as ``naive.py``. Within a chunk of C tokens starting from state S0, with
``G_i`` the in-chunk cumulative log-decay (inclusive) and ``Gamma_i = exp(G_i)`` (per channel),
the state after token t is ``Gamma_t S0 + sum_{j<=t} (Gamma_t / Gamma_j) k_j u_j^T`` where the
"pseudo values" u solve a unit lower-triangular system (the WY / UT form):

    (I + A) u = diag(beta) (v - (k Gamma) S0),   A_ij = beta_i k_i^T diag(Gamma_i / Gamma_j) k_j  (j < i)
    o = (q Gamma) S0 + P u,                      P_ij = q_i^T diag(Gamma_i / Gamma_j) k_j         (j <= i)
    S_C = Gamma_C S0 + (k Gamma_C / Gamma)^T u

So, all chunks at once: ``solve = (I + A)^-1 diag(beta)`` (block-recursive inverse, 16 x 16 base
blocks by one batched triangular solve), ``U = solve v``, P and ``[q Gamma; k Gamma]``. Then the
only sequential part, one loop over chunks, four matmuls each:

    [qS; kS] = [q Gamma; k Gamma] S;  u = U - solve kS;  o = qS + P u;  S <- Gamma_C S + K_hat^T u

(``solve (k Gamma S)`` instead of a precomputed ``W = solve k Gamma``: C x C x V instead of
C x K x V flops per step, and no W to build.)

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

**Chunk size.** 16 by default: with K3's gate that is exactly one sub-block (no pair factors, no
denormals from exp(G) over long chunks), and it does the fewest flops. On the 2-core dev box
(B=1, H=8, K=V=128, T=4096, fp32, 2 threads) chunk sizes 16 / 32 / 64 ran in 0.074 / 0.092 /
0.112 s. See benchmarks/kda.py.

Gradients come from autograd through this form (loop over chunks, not tokens); the per-chunk
pieces are taken with unbind/split so that the backward stays linear in T (about 3.5x forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.kda.inputs import L2NORM_EPS, check_inputs, compute_dtype, default_scale
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


def _intra_chunk(
    qk: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Everything that does not depend on the state, for Z chunks at once.

    qk: [Z, 2, n, s, K] (q rows then k rows, in n sub-blocks of s tokens); v: [Z, C, V];
    g: [Z, n, s, K]; beta: [Z, C]. Returns
    ``[q Gamma; k Gamma]`` [Z, 2C, K], ``(I + A)^-1 diag(beta)`` [Z, C, C], U [Z, C, V], P [Z, C, C],
    ``K_hat = k Gamma_C / Gamma`` [Z, C, K] and ``Gamma_C`` [Z, K].
    """
    Z, _, n, s, K = qk.shape
    C = n * s
    # Block-level log-decays are direct sums of same-sign terms (g <= 0), never differences of two
    # long prefix sums, which would lose |prefix| * eps; ``local`` subtracts a single step.
    within = g.cumsum(dim=2)  # [Z, n, s, K] inclusive sums inside each sub-block
    head = g[:, :, 0]  # g of each block's first token (its reference) [Z, n, K]
    local = within - head.unsqueeze(2)  # Gl = G_j - G_first: sum over (first_b, j], in [-EXP_LIMIT, 0]
    rest = local[:, :, -1]  # sum over the block after its first token [Z, n, K]
    totals = within[:, :, -1]  # [Z, n, K]
    first = F.pad(totals[:, :-1].cumsum(dim=1), (0, 0, 1, 0)) + head  # G at each block's first token
    after = F.pad(totals[:, 1:].flip(1).cumsum(dim=1).flip(1), (0, 0, 0, 1))  # sum over later blocks
    chunk_total = totals.sum(dim=1)  # G_C [Z, K]

    decay_in, decay_out = _ExpBothWays.apply(local)  # exp(Gl) in [e^-80, 1], exp(-Gl) in [1, e^80]
    left = qk * decay_in.unsqueeze(1)  # [Z, 2, n, s, K]: rows of P (q), then of A (k)
    k_out = qk[:, 1] * decay_out  # [Z, n, s, K]
    if n == 1:
        scores = torch.bmm(left.view(Z, 2 * C, K), k_out.view(Z, C, K).transpose(1, 2))  # [Z, 2C, C]
    else:
        # gap[a, b] = G_first(a) - G_first(b) = sum of the steps first(b') - first(b'-1), b < b' <= a
        steps = rest[:, :-1] + head[:, 1:]  # [Z, n - 1, K], step b' = 1 .. n-1
        after_b = torch.ones(n - 1, n, dtype=g.dtype, device=g.device).tril().view(1, n - 1, n, 1)
        gap = F.pad((steps.unsqueeze(2) * after_b).cumsum(dim=1), (0, 0, 0, 0, 1, 0))  # [Z, n(a), n(b), K]
        later = torch.ones(n, n, dtype=torch.bool, device=g.device).triu(1).view(1, n, n, 1)
        pair = gap.masked_fill(later, float("-inf")).exp()  # exp(gap) for b <= a, 0 above
        right = (k_out.unsqueeze(1) * pair.unsqueeze(3)).view(Z, n, C, K)  # [Z, n(a), C, K]
        by_block = left.transpose(1, 2).reshape(Z, n, 2 * s, K)  # row block a: its q rows, its k rows
        scores = torch.matmul(by_block, right.transpose(-1, -2)).view(Z, n, 2, s, C)
        scores = scores.transpose(1, 2).reshape(Z, 2 * C, C)
    rows = torch.arange(C, device=g.device).view(C, 1)
    cols = torch.arange(C, device=g.device)
    # above the diagonal, inside a block, scores hold exp(Gl_i - Gl_j) > 1 (finite, <= e^EXP_LIMIT)
    p = scores[:, :C] * (cols <= rows).to(g.dtype)  # [Z, C, C], j <= i
    a = scores[:, C:] * ((cols < rows).to(g.dtype) * beta.unsqueeze(-1))  # j < i, times beta_i

    first_decay = first.exp().unsqueeze(2).unsqueeze(1)  # Gamma at each block's first token
    qk_gamma = (left * first_decay).view(Z, 2 * C, K)  # [q Gamma; k Gamma]
    # Gamma_C / Gamma_j = exp(-Gl_j) * exp(rest_b + after_b)
    k_hat = (k_out * (rest + after).exp().unsqueeze(2)).view(Z, C, K)
    solve = unit_lower_inverse(a) * beta.unsqueeze(-2)  # (I + A)^-1 diag(beta) [Z, C, C]
    return qk_gamma, solve, torch.bmm(solve, v), p, k_hat, chunk_total.exp()


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
    chunk_size: int = 16,
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
    if T > 0:
        g_min, g_max = (x.item() for x in torch.aminmax(g.detach()))
        if g_max > 0:
            raise ValueError(f"g is a log-decay and must be <= 0, got max {g_max}")
    else:
        g_min = 0.0
    s = sub_block_size(g_min, chunk_size)
    n = chunk_size // s
    # q gets the scale; with the L2 norm it is folded into the normalising factor
    qk_scale = torch.tensor([default_scale(scale, K), 1.0], dtype=dtype).view(2, 1, 1, 1)

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
        # [t, N, H, 2, C, K] -> [Z, 2, n, s, K]: one copy (and dtype cast) for q and k together
        qk = torch.stack([q_t, k_t], dim=3).to(dtype).view(Z, 2, n, s, K)
        if use_qk_l2norm:
            qk = qk * (qk_scale / torch.sqrt((qk * qk).sum(dim=-1, keepdim=True) + L2NORM_EPS))
        else:
            qk = qk * qk_scale
        qk_gamma, solve, u_all, p, k_hat, chunk_decay = _intra_chunk(
            qk,
            v_t.reshape(Z, C, V).to(dtype),
            g_t.reshape(Z, n, s, K).to(dtype),
            beta_t.reshape(Z, C).to(dtype),
        )
        # per-chunk pieces by unbind/split, not indexing: their backward is one stack/cat, whereas
        # each index's backward would write into a zero tensor the size of the whole tile
        per_step = zip(
            qk_gamma.view(-1, N * H, 2 * C, K).unbind(0),
            solve.view(-1, N * H, C, C).unbind(0),
            u_all.view(-1, N * H, C, V).unbind(0),
            p.view(-1, N * H, C, C).unbind(0),
            k_hat.view(-1, N * H, C, K).unbind(0),
            chunk_decay.view(-1, N * H, K, 1).unbind(0),
            strict=True,
        )
        for qk_gamma_i, solve_i, u_i, p_i, k_hat_i, decay_i in per_step:  # one state update per chunk
            read_q, read_k = torch.bmm(qk_gamma_i, state).split(C, dim=1)  # (q Gamma) S, (k Gamma) S
            u = torch.baddbmm(u_i, solve_i, read_k, alpha=-1)  # pseudo values [N*H, C, V]
            outputs.append(torch.baddbmm(read_q, p_i, u))
            state = torch.baddbmm(state * decay_i, k_hat_i.transpose(1, 2), u)
    o = torch.stack(outputs).view(layout.steps, N, H, C, V) if outputs else v.new_zeros(0, N, H, C, V)
    o = layout.to_tokens(o).to(in_dtype)
    final = state.view(N, H, K, V) if output_final_state else None
    return o, final
