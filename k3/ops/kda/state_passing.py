"""The inter-chunk recurrence of chunked KDA, the only sequential part, with a hand-written backward.

Per chunk i (batched over Z = sequences x heads), from the state S_i [K, V] at its start:

    R_i = (q Gamma)_i S_i                 [C, V]   what the chunk's queries read of earlier chunks
    u_i = U_i - W_i S_i                   [C, V]   pseudo values (W = (I + A)^-1 diag(beta) k Gamma)
    S_{i+1} = gamma_i * S_i + K_hat_i^T u_i        gamma = Gamma_C per key channel

Everything that does not need the state (W, U, K_hat, gamma, and afterwards o = R + P u) is
computed for all chunks at once outside. Autograd through this loop would record ~6 small ops per
chunk and replay each one; the backward below runs the adjoint recurrence instead and takes
everything else as large batched matmuls over all chunks afterwards:

    du'_i = du_i + K_hat_i dS_{i+1}                                (total gradient of u_i)
    dS_i  = gamma_i * dS_{i+1} + (q Gamma)_i^T dR_i - W_i^T du'_i  (dS_n = d final state)
    d(q Gamma)_i = dR_i S_i^T,  dW_i = -du'_i S_i^T,  dK_hat_i = u_i dS_{i+1}^T,
    dgamma_i = sum_V S_i * dS_{i+1},  dU_i = du'_i,  d initial state = dS_0

The forward keeps only the first state; the backward recomputes the others (one scaled rank-C update
per chunk) instead of holding [steps, Z, K, V] between the passes.

Two implementations of the two loops, the same arithmetic: torch ops per chunk (any dtype and
device), and the native kernels of ``_native.cpp`` (fp32 on CPU: each thread takes whole heads
through all chunks with the state in cache, ~1.8x faster). chunk_kda uses this Function where it
builds chunks by merges; with one base chunk per chunk it runs the fused kernels of ``fused.py``.
"""

from __future__ import annotations

from types import ModuleType

import torch


def forward_loop(q_gamma, w, u_in, k_hat, decay, state):
    """(reads, u, final state) with one torch op per product; shapes as in :class:`StatePassing`."""
    steps = q_gamma.shape[0]
    reads, u = torch.empty_like(u_in), torch.empty_like(u_in)
    states = state.new_empty(2, *state.shape)  # S_i and S_{i+1}, in turn
    states[0].copy_(state)
    k_hat_t, gamma = k_hat.transpose(-1, -2), decay.unsqueeze(-1)  # [steps, Z, K, C], [steps, Z, K, 1]
    for i in range(steps):
        now, after = states[i % 2], states[(i + 1) % 2]
        torch.bmm(q_gamma[i], now, out=reads[i])
        torch.baddbmm(u_in[i], w[i], now, alpha=-1, out=u[i])
        torch.mul(now, gamma[i], out=after)
        after.baddbmm_(k_hat_t[i], u[i])
    return reads, u, states[steps % 2].clone()


def state_history(k_hat, u, decay, state):
    """[steps + 1, Z, K, V]: the state at the start of every chunk, then the final one."""
    steps = k_hat.shape[0]
    states = state.new_empty(steps + 1, *state.shape)
    states[0].copy_(state)
    k_hat_t, gamma = k_hat.transpose(-1, -2), decay.unsqueeze(-1)
    for i in range(steps):
        torch.mul(states[i], gamma[i], out=states[i + 1])
        states[i + 1].baddbmm_(k_hat_t[i], u[i])
    return states


def backward_loop(q_gamma, w, k_hat, decay, u, states, d_reads, d_u, d_final):
    """Every gradient, ``(d q_gamma, d w, d u_in, d k_hat, d decay, d state)``: the adjoint recurrence,
    then the products with the states as batched matmuls over all chunks. ``states``: state_history."""
    steps, Z, C, K = q_gamma.shape
    V = u.shape[-1]
    d_states = d_final.new_empty(steps + 1, *d_final.shape)  # dS_i; dS_n = d final state
    d_states[steps].copy_(d_final)
    du = torch.empty_like(d_u)
    q_gamma_t, w_t, gamma = q_gamma.transpose(-1, -2), w.transpose(-1, -2), decay.unsqueeze(-1)
    for i in reversed(range(steps)):
        d_next = d_states[i + 1]
        torch.baddbmm(d_u[i], k_hat[i], d_next, out=du[i])
        torch.mul(d_next, gamma[i], out=d_states[i])
        d_states[i].baddbmm_(q_gamma_t[i], d_reads[i])
        d_states[i].baddbmm_(w_t[i], du[i], alpha=-1)
    before = states[:steps].view(-1, K, V)  # S_i
    after = d_states[1:].view(-1, K, V)  # dS_{i+1}
    d_q_gamma = torch.bmm(d_reads.reshape(-1, C, V), before.transpose(1, 2)).view(q_gamma.shape)
    d_w = torch.bmm(du.view(-1, C, V), before.transpose(1, 2)).neg_().view(w.shape)
    d_k_hat = torch.bmm(u.view(-1, C, V), after.transpose(1, 2)).view(k_hat.shape)
    d_decay = (before * after).sum(dim=-1).view(decay.shape)
    return d_q_gamma, d_w, du, d_k_hat, d_decay, d_states[0]


class StatePassing(torch.autograd.Function):
    """``(reads, u, final_state) = StatePassing.apply(q_gamma, w, u_in, k_hat, decay, state, native)``.

    q_gamma, w, k_hat [steps, Z, C, K]; u_in [steps, Z, C, V] (U); decay [steps, Z, K] (Gamma_C);
    state [Z, K, V]; ``native``: the kernel module of ``_native.cpp`` (fp32 CPU inputs, made
    contiguous here) or None for the torch loops. Returns reads [steps, Z, C, V] ((q Gamma) S),
    u [steps, Z, C, V], final state [Z, K, V].
    """

    @staticmethod
    def forward(ctx, q_gamma, w, u_in, k_hat, decay, state, native: ModuleType | None):
        if native is not None:
            q_gamma, w, u_in, k_hat, decay, state = (
                x.contiguous() for x in (q_gamma, w, u_in, k_hat, decay, state)
            )
        reads, u, final = (native.state_forward if native else forward_loop)(
            q_gamma, w, u_in, k_hat, decay, state
        )
        ctx.native = native
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(q_gamma, w, k_hat, decay, state, u)
        return reads, u, final

    @staticmethod
    def backward(ctx, d_reads, d_u, d_final):
        q_gamma, w, k_hat, decay, state, u = ctx.saved_tensors
        native = ctx.native
        if native is not None:
            d_reads, d_u, d_final = (x.contiguous() for x in (d_reads, d_u, d_final))
        # the states again from the saved first one (cheaper than keeping them: fresh memory for
        # every state would cost a page fault per 4 kB, and [steps, Z, K, V] is large)
        states = (native.state_history if native else state_history)(k_hat, u, decay, state)
        grads = (native.state_backward if native else backward_loop)(
            q_gamma, w, k_hat, decay, u, states, d_reads, d_u, d_final
        )
        return *grads, None
