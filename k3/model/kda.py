"""The KDA layer (Kimi Delta Attention): short convs, gates, the delta-rule recurrence, gated output norm.

Per head h (head_dim d):
    q, k, v = silu(shortconv(W x))          separate causal depthwise convs of width ks (4)
    g       = gate(f_b(f_a(x)))             log-decay per channel [B, T, H, d], <= 0
    beta    = sigmoid(b_proj x)             [B, T, H]
    o, S    = kda(l2norm(q), l2norm(k), v, g, beta)   the op (k3.ops.kda), state S [d_k, d_v] fp32;
                                              l2norm(x) = x / sqrt(sum x^2 + kda_l2norm_eps)
    out     = o_proj(rms_per_head(o, o_norm) * sigmoid(g_proj x))

K3 uses the bounded gate `lb * sigmoid(exp(A_log) * (f + dt_bias))` and a full-rank output gate `g_proj`;
Kimi Linear the softplus gate `-exp(A_log) * softplus(f + dt_bias)` and a low-rank one `g_b(g_a(x))`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.layout import kda_a_log_shape
from k3.model.cache import KDAState
from k3.model.norm import Linear, RMSNorm, as_dtype
from k3.ops.kda import chunk_kda, kda_gate, kda_softplus_gate, recurrent_kda_step
from k3.ops.kda.decode import kda_decode_step


class ShortConv(nn.Module):
    """Causal depthwise conv of width ks over time, then SiLU. `weight` [P, 1, ks] as published (F32).

    Works in the [B, T, P] layout as a sum of ks shifted products (no transposes). The tail it carries
    between calls is the last ks-1 inputs, [B, ks-1, P].
    """

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel_size))
        self.kernel_size = kernel_size

    def forward(
        self, x: torch.Tensor, tail: torch.Tensor | None = None, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, P] -> (silu(conv(x)) [B, T, P], new tail [B, ks-1, P]).

        `counts` [B]: real tokens per row (right padding); the new tail ends at each row's last real token.
        """
        B, T, P = x.shape
        width = self.kernel_size - 1
        if tail is None:
            tail = x.new_zeros(B, width, P)
        full = torch.cat([as_dtype(tail, x.dtype), x], dim=1)  # [B, ks-1+T, P]
        # [ks, P]: each tap's weights contiguous (a strided [P] operand takes torch's slow broadcast: at
        # T = 2,048, P = 12,288 in bf16 98.6 ms a conv against 41.5)
        w = as_dtype(self.weight[:, 0, :].t(), x.dtype).contiguous()
        y = full[:, 0:T] * w[0]
        for j in range(1, self.kernel_size):
            y = y + full[:, j : j + T] * w[j]
        if counts is None:
            new_tail = full[:, T:]
        else:  # row b's last real inputs sit at full[b, counts[b] : counts[b] + ks-1]
            idx = counts[:, None] + torch.arange(width, device=x.device)  # [B, ks-1]
            new_tail = full.gather(1, idx[:, :, None].expand(B, width, P))
        return F.silu(y), new_tail


class KDAttention(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        H, P, d = cfg.hidden_size, cfg.kda_proj_size, cfg.kda_head_dim
        self.num_heads, self.head_dim = cfg.kda_num_heads, d
        self.lower_bound = cfg.kda_gate_lower_bound  # None = softplus gate (Kimi Linear)
        self.q_proj, self.k_proj, self.v_proj = Linear(H, P), Linear(H, P), Linear(H, P)
        ks = cfg.kda_short_conv_kernel_size
        self.q_conv1d, self.k_conv1d, self.v_conv1d = ShortConv(P, ks), ShortConv(P, ks), ShortConv(P, ks)
        self.f_a_proj = Linear(H, d)
        self.f_b_proj = Linear(d, P)
        # K3: flat [max(heads, d)] (first `heads` entries used); Kimi Linear: [1, 1, heads, 1]
        self.A_log = nn.Parameter(torch.zeros(kda_a_log_shape(cfg)))
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.b_proj = Linear(H, self.num_heads)
        self.full_rank_gate = cfg.kda_use_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = Linear(H, P)
        else:
            self.g_a_proj = Linear(H, d)
            self.g_b_proj = Linear(d, P)
        self.o_norm = RMSNorm(d, cfg.rms_norm_eps)  # per head, F32
        self.l2norm_eps = cfg.kda_l2norm_eps  # q and k, inside the op
        self.o_proj = Linear(P, H)
        self.fast_decode = True  # one token after a prefill: `decode` (one native call); False: `forward`'s

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """g [B, T, H, d] fp32, the per-channel log-decay."""
        B, T, _ = x.shape
        f = self.f_b_proj(self.f_a_proj(x)).view(B, T, self.num_heads, self.head_dim)
        if self.lower_bound is None:
            return kda_softplus_gate(f, self.A_log, self.dt_bias)  # A_log: first `heads` entries used
        return kda_gate(f, self.A_log, self.dt_bias, self.lower_bound)

    def forward(
        self, x: torch.Tensor, state: KDAState | None = None, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, T, hidden] (already normalised) -> [B, T, hidden]; reads and updates `state` if given.

        `counts` [B]: real tokens per row (right padding); padded positions leave the state untouched.
        """
        B, T, _ = x.shape
        if (
            self.fast_decode
            and T == 1
            and counts is None
            and state is not None
            and state.recurrent is not None
            and not torch.is_grad_enabled()  # the native decode step has no backward
        ):
            return self.decode(x, state)
        heads = (B, T, self.num_heads, self.head_dim)
        tails = (None, None, None) if state is None else (state.conv_q, state.conv_k, state.conv_v)
        q, tail_q = self.q_conv1d(self.q_proj(x), tails[0], counts)
        k, tail_k = self.k_conv1d(self.k_proj(x), tails[1], counts)
        v, tail_v = self.v_conv1d(self.v_proj(x), tails[2], counts)
        g = self.log_decay(x)  # [B, T, H, d] fp32
        beta = torch.sigmoid(as_dtype(self.b_proj(x), torch.float32))  # [B, T, H]
        if counts is not None:  # padded positions: g = 0, beta = 0, so S is left as it was
            real = torch.arange(T, device=x.device)[None, :] < counts[:, None]  # [B, T]
            g = g * real[:, :, None, None]
            beta = beta * real[:, :, None]
        initial = None if state is None else state.recurrent
        op = recurrent_kda_step if (initial is not None and T == 1) else chunk_kda
        o, final = op(
            q.view(heads),
            k.view(heads),
            v.view(heads),
            g,
            beta,
            initial_state=initial,
            output_final_state=state is not None,
            use_qk_l2norm=True,
            l2norm_eps=self.l2norm_eps,
        )  # o [B, T, H, d]
        if state is not None:
            state.conv_q, state.conv_k, state.conv_v, state.recurrent = tail_q, tail_k, tail_v, final
        gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))  # [B, T, P]
        o = self.o_norm(as_dtype(o, torch.float32)) * torch.sigmoid(
            as_dtype(gate, torch.float32).view(heads)
        )  # fp32, as transformers' RMSNormGated
        return self.o_proj(as_dtype(o.reshape(B, T, -1), x.dtype))

    def decode(self, x: torch.Tensor, state: KDAState) -> torch.Tensor:
        """`forward` for one token per sequence with a state: x [B, 1, hidden] -> [B, 1, hidden].

        The convs, L2 norms and recurrence run in one call (k3.ops.kda.decode); the state gets new tensors.
        """
        B = x.shape[0]
        heads = (B, self.num_heads, self.head_dim)
        x2 = x.view(B, -1)  # [B, hidden]
        projections = (self.q_proj(x2), self.k_proj(x2), self.v_proj(x2))  # [B, P] each
        tails = (state.conv_q, state.conv_k, state.conv_v)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        weights = tuple(as_dtype(c.weight.view(c.weight.shape[0], -1), x.dtype) for c in convs)  # [P, ks]
        g = self.log_decay(x).view(heads)  # [B, H, d] fp32
        beta = torch.sigmoid(as_dtype(self.b_proj(x2), torch.float32))  # [B, H]
        o, new_tails, state.recurrent = kda_decode_step(
            projections,
            tails,
            weights,
            g,
            beta,
            state.recurrent,  # type: ignore[arg-type]
        )  # o [B, H, d]
        state.conv_q, state.conv_k, state.conv_v = new_tails
        gate = self.g_proj(x2) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x2))  # [B, P]
        o = self.o_norm(o) * torch.sigmoid(as_dtype(gate, torch.float32).view(heads))
        return self.o_proj(as_dtype(o.reshape(B, 1, -1), x.dtype))
