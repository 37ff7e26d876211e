"""Gated MLA (multi-head latent attention) without positional encoding, plain and weight-absorbed.

    q          = q_b(rms(q_a(x)))  or  q_proj(x)                  [B, T, n, dn + dr]
    c, k_r     = split(kv_a_proj_with_mqa(x), [kv_lora, dr]);  c = rms(c, kv_a_layernorm)
    k_n, v     = split(kv_b(c), [dn, dv]) per head;  k = [k_n, k_r]  (k_r shared by all heads)
    o          = softmax(q k^T / sqrt(dn + dr) + causal) v;  o = o * sigmoid(g_proj x);  o_proj(o)

The "rope" dims are ordinary dims (no RoPE anywhere). Two equal ways to attend:

* plain: expand every cached latent through kv_b into keys and values (prefill, training);
* absorbed: fold kv_b into the query (`q_n W_k`, a query in latent space) and into the output
  (`(p c) W_v^T`), so attention runs directly on the cached latents: cheaper when T (new tokens) is small
  relative to the context, i.e. decoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.cache import MLAState
from k3.model.norm import Linear, RMSNorm, as_dtype


class MLAttention(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        H, n = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.kv_lora = n, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.scale = cfg.qk_head_dim**-0.5
        eps = cfg.mla_latent_norm_eps  # not rms_norm_eps: see K3Config and docs/epsilons.md
        self.q_lora = cfg.q_lora_rank is not None  # low-rank queries (K3) or one q_proj (Kimi Linear)
        if not self.q_lora:
            self.q_proj = Linear(H, n * cfg.qk_head_dim)
        else:
            self.q_a_proj = Linear(H, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, n * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(H, self.kv_lora + self.rope)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, eps)
        self.kv_b_proj = Linear(self.kv_lora, n * (self.nope + self.v_dim))
        self.kv_b_proj.tileable = False  # the absorbed paths read its rows head by head in place
        # Bytes the plain form may expand a chunk's cached keys into (kv_b of every position, keys and values
        # padded for sdpa: 240 KiB a position at K3's 96 heads in fp32); a chunk over a longer context takes
        # the absorbed form, whose [heads, chunk, context] scores the engine's chunks keep within the same
        # budget (k3.engine.generate.Engine.chunk_size), which the engine sets here
        # (K3ForCausalLM.set_attention_budget); 512 MiB, the engine's default, without one.
        self.plain_budget = 512 * 2**20
        self.output_gate = cfg.mla_use_output_gate
        if self.output_gate:
            self.g_proj = Linear(H, n * self.v_dim)
        self.o_proj = Linear(n * self.v_dim, H)

    # ---- the pieces --------------------------------------------------------------------------------------
    def queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> q_nope [B, T, n, dn], q_rope [B, T, n, dr]."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        return q.view(B, T, self.num_heads, -1).split([self.nope, self.rope], dim=-1)

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> normalised latent c [B, T, kv_lora], shared k_rope [B, T, dr] (cached)."""
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        return self.kv_a_layernorm(c), k_rope

    def attend_plain(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        c: torch.Tensor,
        k_rope: torch.Tensor,
        visible: torch.Tensor | None,
    ) -> torch.Tensor:
        """Queries [B, T, n, .] over latents c [B, S, L], k_rope [B, S, dr] -> o [B, T, n, dv].

        `visible` [B, T, S] bool, or None for the plain causal mask (S == T).
        """
        B, S, _ = c.shape
        n = self.num_heads
        # torch's fused CPU attention kernel needs one head size for q, k and v: zero-pad the smaller
        # (zeros change neither the scores, the scale being explicit, nor the kept output columns)
        width = max(self.nope + self.rope, self.v_dim)

        def padded(t: torch.Tensor) -> torch.Tensor:
            return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))

        kv = self.kv_b_proj(c).view(B, S, n, -1)  # [B, S, n, dn + dv]
        k_nope, rope = kv[..., : self.nope], k_rope[:, :, None, :].expand(B, S, n, self.rope)
        k = padded(torch.cat([k_nope, rope], dim=-1))  # [B, S, n, width]
        v = padded(kv[..., self.nope :])
        del kv, k_nope  # their values are in k and v now (or v is a view): gone before the attention runs
        q = padded(torch.cat([q_nope, q_rope], dim=-1))  # [B, T, n, width]
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=None if visible is None else visible[:, None],
            is_causal=visible is None,
            scale=self.scale,
        )  # [B, n, T, width]
        return o.transpose(1, 2)[..., : self.v_dim]

    def attend_absorbed(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        c: torch.Tensor,
        k_rope: torch.Tensor,
        visible: torch.Tensor | None,
    ) -> torch.Tensor:
        """Same result as `attend_plain`, with kv_b folded into the query and the output."""
        B, T, n, _ = q_nope.shape
        S = c.shape[1]
        if visible is None and T > 1:  # causal; a single query (T = 1) sees all S keys: no mask
            visible = torch.ones(T, S, dtype=torch.bool, device=c.device).tril(S - T)[None].expand(B, T, S)
        w = as_dtype(self.kv_b_proj.weight, c.dtype).view(n, self.nope + self.v_dim, self.kv_lora)
        w_k, w_v = w[:, : self.nope], w[:, self.nope :]  # [n, dn, L], [n, dv, L]
        q_latent = torch.einsum("bthd,hdl->bthl", q_nope, w_k)  # [B, T, n, L]
        scores = torch.einsum("bthl,bsl->bhts", q_latent, c) + torch.einsum("bthr,bsr->bhts", q_rope, k_rope)
        scores = as_dtype(scores, torch.float32) * self.scale
        if visible is not None:
            scores = scores.masked_fill(~visible[:, None], float("-inf"))
        p = as_dtype(scores.softmax(dim=-1), c.dtype)  # [B, n, T, S]
        o_latent = torch.einsum("bhts,bsl->bthl", p, c)  # [B, T, n, L]
        return torch.einsum("bthl,hdl->bthd", o_latent, w_v)  # [B, T, n, dv]

    def plain_bytes(self, keys: int, queries: int, element_size: int, rows: int = 1) -> int:
        """Bytes `attend_plain` takes for a chunk of `queries` queries over `keys` positions (the chunk's the
        last of them) in each of `rows` sequences, at `element_size` bytes a value, at most: the positions
        expanded, kv_b's [n, dn + dv] while the keys and values padded to one width are made from it (and
        the keys [n, dq] before their padding, where they have any); and where the chunk follows cached
        context (keys > queries), the visibility mask of every query and key, as bool and as the floats
        sdpa turns it into (5 bytes a pair; measured: 4.25 bytes a pair grown inside sdpa at 2,048 x 8,192).
        A chunk with nothing before it attends under sdpa's causal mask, which takes no memory."""
        dq, width = self.nope + self.rope, max(self.nope + self.rope, self.v_dim)
        per_head = self.nope + self.v_dim + 2 * width + (dq if dq < width else 0)
        mask = 5 * queries * keys if keys > queries else 0
        return rows * (keys * self.num_heads * per_head * element_size + mask)

    # ---- the layer ---------------------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        state: MLAState | None = None,
        counts: torch.Tensor | None = None,
        absorb: bool | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden] (already normalised) -> [B, T, hidden].

        With a state, the chunk's latents are appended (see k3.model.cache) and attention covers the cached
        context. `absorb`: use the weight-absorbed form; default: with a state, for one-token steps and for
        chunks whose context the plain form would expand past `plain_budget` bytes.
        """
        B, T, _ = x.shape
        q_nope, q_rope = self.queries(x)
        c, k_rope = self.latents(x)
        visible = None
        if state is not None:
            if counts is None:
                counts = torch.full((B,), T, dtype=torch.long, device=x.device)
            offsets = state.append(c, k_rope, counts)  # [B]
            S = int(offsets.max()) + T
            c, k_rope = state.latent[:, :S], state.k_rope[:, :S]  # type: ignore[index]
            if absorb is None:
                absorb = T == 1 or self.plain_bytes(S, T, x.element_size(), B) > self.plain_budget
            if S == T:  # every row starts here: the plain causal mask, whose masked blocks sdpa skips
                visible = None
            elif not (absorb and B == 1 and T == 1):  # one query of one sequence sees every cached key
                last_key = offsets[:, None] + torch.arange(T, device=x.device)  # [B, T]
                visible = torch.arange(S, device=x.device)[None, None, :] <= last_key[:, :, None]  # [B, T, S]
        attend = self.attend_absorbed if absorb else self.attend_plain
        o = attend(q_nope, q_rope, c, k_rope, visible).reshape(B, T, -1)  # [B, T, n * dv]
        if self.output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)
