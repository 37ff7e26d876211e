"""The inter-chunk recurrence of chunked KDA, the only sequential part, with a hand-written backward.

Per chunk i (batched over Z = sequences x heads), from the state S_i [K, V] at its start:

    R_i = [q Gamma; W]_i S_i          [2C, V]   reads: (q Gamma) S for the output, W S for the values
    u_i = U_i - (W S)_i               [C, V]    pseudo values (W = (I + A)^-1 diag(beta) k Gamma)
    S_{i+1} = gamma_i * S_i + K_hat_i^T u_i     gamma = Gamma_C per key channel [K, 1]

Everything that does not need the state (W, U, K_hat, gamma, and afterwards o = R_q + P u) is
computed for all chunks at once outside. Autograd through this loop would record ~6 small ops per
chunk and replay each one; the backward below runs the adjoint recurrence with three matmul-sized
ops per chunk and takes everything else as large batched matmuls over all chunks afterwards:

    dS_i    = gamma_i * dS_{i+1} + [q Gamma; W]_i^T dR'_i     (dS_n = d final state)
    du'_i   = du_i + K_hat_i dS_{i+1}                          (total gradient of u_i)
    dR'_i   = dR_i - [0; du'_i]                                (W S feeds u with a minus sign)
    d[q Gamma; W]_i = dR'_i S_i^T,  dK_hat_i = u_i dS_{i+1}^T,  dgamma_i = sum_V S_i * dS_{i+1},
    dU_i = du'_i,  d initial state = dS_0

The forward keeps only the first state; the backward recomputes the others (one mul and one
matmul per chunk) instead of holding [steps, Z, K, V] between the passes.
"""

from __future__ import annotations

import torch


class StatePassing(torch.autograd.Function):
    """``(reads, u, final_state) = StatePassing.apply(xw, u_in, k_hat, decay, state)``.

    xw [steps, Z, 2C, K] (q Gamma rows, then W rows); u_in [steps, Z, C, V] (U); k_hat
    [steps, Z, C, K]; decay [steps, Z, K, 1] (Gamma_C); state [Z, K, V]. Returns reads
    [steps, Z, 2C, V] (R: (q Gamma) S rows, then W S rows), u [steps, Z, C, V], final state [Z, K, V].
    """

    @staticmethod
    def forward(ctx, xw, u_in, k_hat, decay, state):
        steps, Z, C2, K = xw.shape
        C = C2 // 2
        reads = xw.new_empty(steps, Z, C2, state.shape[-1])
        u = torch.empty_like(u_in)
        states = xw.new_empty(2, Z, K, state.shape[-1])  # S_i and S_{i+1}, in turn
        states[0].copy_(state)
        k_hat_t = k_hat.transpose(-1, -2)  # [steps, Z, K, C]
        for i in range(steps):
            now, after = states[i % 2], states[(i + 1) % 2]
            torch.bmm(xw[i], now, out=reads[i])
            torch.sub(u_in[i], reads[i, :, C:], out=u[i])
            torch.mul(now, decay[i], out=after)
            after.baddbmm_(k_hat_t[i], u[i])
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(xw, k_hat, decay, state, u)
        return reads, u, states[steps % 2].clone()

    @staticmethod
    def backward(ctx, d_reads, d_u, d_final):
        xw, k_hat, decay, state, u = ctx.saved_tensors
        steps, Z, C2, K = xw.shape
        C, V = C2 // 2, u.shape[-1]
        # the states again from the saved first one (cheaper than keeping them: fresh memory for
        # every state would cost a page fault per 4 kB, and [steps, Z, K, V] is large)
        states = xw.new_empty(steps + 1, Z, K, V)
        states[0].copy_(state)
        k_hat_t = k_hat.transpose(-1, -2)
        for i in range(steps):
            torch.mul(states[i], decay[i], out=states[i + 1])
            states[i + 1].baddbmm_(k_hat_t[i], u[i])
        d_states = states.new_empty(states.shape)  # dS_i; dS_n = d final state
        d_states[steps].copy_(d_final)
        d_reads = d_reads.clone()  # becomes dR' in place: the W S rows get -du'
        du = torch.empty_like(u)  # du'
        xw_t = xw.transpose(-1, -2)  # [steps, Z, K, 2C]
        for i in reversed(range(steps)):
            d_next = d_states[i + 1]
            torch.baddbmm(d_u[i], k_hat[i], d_next, out=du[i])
            d_reads[i, :, C:].sub_(du[i])
            torch.mul(d_next, decay[i], out=d_states[i])
            d_states[i].baddbmm_(xw_t[i], d_reads[i])
        before, after = states[:steps].view(-1, K, V), d_states[1:].view(-1, K, V)
        d_xw = torch.bmm(d_reads.view(-1, C2, V), before.transpose(1, 2)).view(xw.shape)
        d_k_hat = torch.bmm(u.view(-1, C, V), after.transpose(1, 2)).view(k_hat.shape)
        d_decay = (before * after).sum(dim=-1, keepdim=True).view(decay.shape)
        return d_xw, du, d_k_hat, d_decay, d_states[0]
