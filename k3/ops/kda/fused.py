"""chunk_kda in two native calls: the fused forward and backward of ``_native.cpp``.

Used by :func:`k3.ops.kda.chunk_kda` for fp32 CPU work when one base chunk is the whole chunk (K3's
gate at the default chunk of 16). Each call goes from the token layout to the token layout: every
(sequence, head) is one thread's job, chunk after chunk, with the chunk's terms built in scratch
memory (the same arithmetic as ``base_terms`` and ``StatePassing``) and nothing else written.
Under autograd the forward also keeps every chunk's starting state and pseudo values, and the
backward walks the chunks backwards from them, each chunk rebuilding its terms. Those states are
K * V floats per head and chunk, twice the size of q, k, v and g together at K3's shapes; with
``keep_states=False`` only the inputs are saved and the backward recomputes the states first (it then
takes about 1.4x as long; benchmarks/kda.py). The states are kept transposed, [V, K], as the
backward's products read them.
"""

from __future__ import annotations

from types import ModuleType

import torch

from k3.ops.kda.inputs import default_scale
from k3.ops.kda.layout import sequence_bounds


class FusedChunkKDA(torch.autograd.Function):
    """``(o, final) = FusedChunkKDA.apply(q, k, v, g, beta, state, starts, lengths, options)``.

    q, k, g [rows, H, K]; v [rows, H, V]; beta [rows, H]; state [N, H, K, V]; all fp32, contiguous.
    Sequence n is rows [starts[n], starts[n] + lengths[n]). ``options``: (native module, chunk size,
    the lowest g it takes, scale, L2-normalise q and k, the L2 norm's eps, keep the chunk-start states for a
    backward). Returns o [rows, H, V] and the final states [N, H, K, V]; raises the module's
    ``GateOutOfRange`` where a g lies outside [lowest g, 0].
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state, starts, lengths, options):
        native, chunk_size, g_floor, scale, l2norm, eps, keep = options
        o, final, states, pseudo_values = native.forward(
            q, k, v, g, beta, starts, lengths, state, chunk_size, g_floor, scale, l2norm, eps, keep
        )
        ctx.save_for_backward(q, k, v, g, beta, state, starts, lengths, states, pseudo_values)
        ctx.options = options
        return o, final

    @staticmethod
    def backward(ctx, d_o, d_final):
        q, k, v, g, beta, state, starts, lengths, states, pseudo_values = ctx.saved_tensors
        native, chunk_size, g_floor, scale, l2norm, eps, _ = ctx.options
        d_o = torch.zeros_like(v) if d_o is None else d_o.contiguous()
        d_final = torch.zeros_like(state) if d_final is None else d_final.contiguous()
        inputs = (q, k, v, g, beta, starts, lengths, state, states, pseudo_values)
        grads = native.backward(*inputs, d_o, d_final, chunk_size, g_floor, scale, l2norm, eps)
        return *grads, None, None, None


def fused_chunk_kda(
    native: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    g_floor: float,
    scale: float | None,
    use_qk_l2norm: bool,
    l2norm_eps: float,
    keep_states: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_kda's result ``(o [B, T, H, V] fp32, final state [N, H, K, V] fp32)``, differentiable.

    Sequences are row ranges of the token layout: the B rows of a dense batch, or the packed ones. Every g
    must lie in [g_floor, 0], else the native forward raises ``native.GateOutOfRange``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is None:
        starts, lengths = torch.arange(B) * T, torch.full((B,), T)
    else:
        bounds = torch.tensor(sequence_bounds(cu_seqlens, T))
        starts, lengths = bounds[:-1].contiguous(), (bounds[1:] - bounds[:-1]).contiguous()
    if initial_state is None:
        state = torch.zeros(starts.numel(), H, K, V)
    else:
        state = initial_state.to(torch.float32).contiguous()
    rows = (x.reshape(B * T, *x.shape[2:]).to(torch.float32).contiguous() for x in (q, k, v, g, beta))
    inputs = (q, k, v, g, beta, initial_state)
    keep = keep_states and torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    options = (native, chunk_size, g_floor, default_scale(scale, K), use_qk_l2norm, l2norm_eps, keep)
    o, final = FusedChunkKDA.apply(*rows, state, starts, lengths, options)
    return o.view(B, T, H, V), final
