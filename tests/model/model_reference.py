"""An independent, slow K3 forward pass written straight from docs/spec/K3.md sections 3-5.

For tests only. It shares no code with k3.model or k3.ops: it reads config.json with `json` and the shards
with the official `safetensors` library, decodes MXFP4 itself (E2M1 LUT and 2^(s-127)), runs everything
in float64 with loops over tokens (KDA recurrence, MLA attention rows, MoE experts) and one sequence at a
time. Where the spec leaves a detail open it follows transformers' KimiLinear (MLA latent norms eps 1e-6,
L2 norm `x / sqrt(sum x^2 + 1e-6)`, causal depthwise conv as torch's cross-correlation).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed U8 [out, in/2] (element 2j low nibble), scale U8 [out, in/32] -> float64 [out, in]."""
    lut = torch.tensor(E2M1, dtype=torch.float64)
    low, high = (packed & 0xF).long(), (packed >> 4).long()
    codes = torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)  # [out, in]
    factors = torch.pow(2.0, scale.double() - 127.0).repeat_interleave(32, dim=1)
    return lut[codes] * factors


class ReferenceK3:
    def __init__(self, directory: str | Path, layers: int | None = None) -> None:
        directory = Path(directory)
        raw = json.loads((directory / "config.json").read_text())
        self.c = raw["text_config"]
        lin = self.c["linear_attn_config"]
        self.kda_layers = {i - 1 for i in lin["kda_layers"]}
        self.lin = lin
        self.n_layers = self.c["num_hidden_layers"] if layers is None else layers
        self.w: dict[str, torch.Tensor] = {}
        for shard in sorted(directory.glob("*.safetensors")):
            with safe_open(shard, "pt") as f:
                for name in f.keys():
                    self.w[name] = f.get_tensor(name)
        for name in [n for n in self.w if n.endswith(".weight_packed")]:
            base = name.removesuffix("_packed")
            self.w[base] = decode_mxfp4(self.w.pop(name), self.w.pop(base + "_scale"))
        self.w = {k: v.double() for k, v in self.w.items()}

    # ---- helpers -------------------------------------------------------------------------------------
    def p(self, name: str) -> torch.Tensor:
        return self.w["language_model.model." + name]

    def rms(self, x: torch.Tensor, w: torch.Tensor | None, eps: float | None = None) -> torch.Tensor:
        eps = self.c["rms_norm_eps"] if eps is None else eps
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
        return y if w is None else y * w

    def situ(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        b, c = self.c["activation_situ_beta"], self.c["activation_situ_linear_beta"]
        return b * torch.tanh(g / b) * torch.sigmoid(g) * c * torch.tanh(u / c)

    def mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        g, u = x @ self.p(prefix + "gate_proj.weight").T, x @ self.p(prefix + "up_proj.weight").T
        return self.situ(g, u) @ self.p(prefix + "down_proj.weight").T

    def read(self, values: list[torch.Tensor], site: str) -> torch.Tensor:
        w = self.p(site + "_res_norm.weight") * self.p(site + "_res_proj.weight")[0]
        logits = torch.stack([(self.rms(v, None) * w).sum(-1) for v in values])  # [N, T]
        p = torch.softmax(logits, dim=0)
        return sum(p[i, :, None] * v for i, v in enumerate(values))

    # ---- mixers --------------------------------------------------------------------------------------
    def kda(self, a: str, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        H, d = self.lin["num_heads"], self.lin["head_dim"]
        ks = self.lin["short_conv_kernel_size"]

        def conv(name: str) -> torch.Tensor:
            y = x @ self.p(a + f"{name}_proj.weight").T  # [T, P]
            w = self.p(a + f"{name}_conv1d.weight")[:, 0, :]  # [P, ks]
            out = torch.zeros_like(y)
            for t in range(T):
                for j in range(ks):
                    src = t - (ks - 1) + j
                    if src >= 0:
                        out[t] += w[:, j] * y[src]
            return torch.nn.functional.silu(out).view(T, H, d)

        q, k, v = conv("q"), conv("k"), conv("v")
        f = (x @ self.p(a + "f_a_proj.weight").T) @ self.p(a + "f_b_proj.weight").T  # [T, P]
        A = torch.exp(self.p(a + "A_log")[:H])[:, None]  # [H, 1]
        g = self.lin["gate_lower_bound"] * torch.sigmoid(
            A * (f.view(T, H, d) + self.p(a + "dt_bias").view(H, d))
        )
        beta = torch.sigmoid(x @ self.p(a + "b_proj.weight").T)  # [T, H]
        o = torch.zeros(T, H, d, dtype=torch.float64)
        for h in range(H):
            S = torch.zeros(d, d, dtype=torch.float64)
            for t in range(T):
                qt = q[t, h] / math.sqrt((q[t, h] ** 2).sum() + 1e-6) * d**-0.5
                kt = k[t, h] / math.sqrt((k[t, h] ** 2).sum() + 1e-6)
                S = torch.diag(torch.exp(g[t, h])) @ S
                S = (torch.eye(d, dtype=torch.float64) - beta[t, h] * torch.outer(kt, kt)) @ S
                S = S + beta[t, h] * torch.outer(kt, v[t, h])
                o[t, h] = S.T @ qt
        gate = x @ self.p(a + "g_proj.weight").T  # full-rank output gate [T, P]
        o = self.rms(o, self.p(a + "o_norm.weight")) * torch.sigmoid(gate.view(T, H, d))
        return o.reshape(T, -1) @ self.p(a + "o_proj.weight").T

    def mla(self, a: str, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        T, n = x.shape[0], c["num_attention_heads"]
        dn, dr, dv, L = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        q = self.rms(x @ self.p(a + "q_a_proj.weight").T, self.p(a + "q_a_layernorm.weight"), 1e-6)
        q = (q @ self.p(a + "q_b_proj.weight").T).view(T, n, dn + dr)
        ckr = x @ self.p(a + "kv_a_proj_with_mqa.weight").T
        latent, k_rope = ckr[:, :L], ckr[:, L:]
        kv = self.rms(latent, self.p(a + "kv_a_layernorm.weight"), 1e-6) @ self.p(a + "kv_b_proj.weight").T
        kv = kv.view(T, n, dn + dv)
        o = torch.zeros(T, n, dv, dtype=torch.float64)
        for h in range(n):
            keys = torch.cat([kv[:, h, :dn], k_rope], dim=-1)  # [T, dn + dr]
            for t in range(T):
                scores = keys[: t + 1] @ q[t, h] / math.sqrt(dn + dr)
                o[t, h] = torch.softmax(scores, 0) @ kv[: t + 1, h, dn:]
        o = o.reshape(T, -1) * torch.sigmoid(x @ self.p(a + "g_proj.weight").T)
        return o @ self.p(a + "o_proj.weight").T

    # ---- ffn -----------------------------------------------------------------------------------------
    def moe(self, m: str, x: torch.Tensor) -> torch.Tensor:
        k = self.c["num_experts_per_token"]
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            s = torch.sigmoid(self.p(m + "gate.weight") @ x[t])  # [E]
            chosen = torch.topk(s + self.p(m + "gate.e_score_correction_bias"), k).indices
            p = s[chosen] / s[chosen].sum() * self.c["routed_scaling_factor"]
            z = self.p(m + "routed_expert_down_proj.weight") @ x[t]
            acc = torch.zeros_like(z)
            for weight, e in zip(p, chosen.tolist(), strict=True):
                e_ = f"{m}experts.{e}."
                h = self.situ(self.p(e_ + "w1.weight") @ z, self.p(e_ + "w3.weight") @ z)
                acc += weight * (self.p(e_ + "w2.weight") @ h)
            r = self.p(m + "routed_expert_up_proj.weight") @ self.rms(
                acc, self.p(m + "routed_expert_norm.weight")
            )
            out[t] = r + self.mlp(m + "shared_experts.", x[t : t + 1])[0]
        return out

    # ---- the model -----------------------------------------------------------------------------------
    def logits(self, ids: list[int]) -> torch.Tensor:
        """ids of one sequence -> logits [T, V] float64."""
        partial: torch.Tensor | None = self.p("embed_tokens.weight")[ids]
        blocks: list[torch.Tensor] = []
        size = self.c["attn_res_block_size"]
        for l in range(self.n_layers):  # noqa: E741
            pre = f"layers.{l}."
            x = partial if not blocks else self.read([*blocks, partial], pre + "self_attention")
            if l % size == 0:
                blocks.append(partial)
                partial = None
            xn = self.rms(x, self.p(pre + "input_layernorm.weight"))
            a = self.kda(pre + "self_attn.", xn) if l in self.kda_layers else self.mla(pre + "self_attn.", xn)
            partial = a if partial is None else partial + a
            y = self.read([*blocks, partial], pre + "mlp")
            yn = self.rms(y, self.p(pre + "post_attention_layernorm.weight"))
            dense = l < self.c["first_k_dense_replace"]
            partial = partial + (
                self.mlp(pre + "mlp.", yn) if dense else self.moe(pre + "block_sparse_moe.", yn)
            )
        h = self.read([*blocks, partial], "output_attn")
        return self.rms(h, self.p("norm.weight")) @ self.w["language_model.lm_head.weight"].T
