"""NeMo Automodel 0.7.0's Kimi K3 (`nemo_automodel.components.models.kimi_k3`) as an external oracle, on CPU.

NeMo's KDA calls flash-linear-attention's GPU kernels (`ShortConvolution`, `FusedRMSNormGated`,
`chunk_kda`, `fused_recurrent_kda`; fla is not installed: its kernels are Triton). They are routed here to
PyTorch written from the spec (/work/shared/spec/K3.md, section 4, "KDA layer"), not to k3's code:

* `ShortConvolution`: causal depthwise conv of width 4 over time, then SiLU (weight [P, 1, 4], fp32);
* `FusedRMSNormGated(activation="sigmoid")`: `rms(o) * weight * sigmoid(gate)` per head, fp32;
* `chunk_kda` / `fused_recurrent_kda`: the delta rule one token at a time, in float64:
  `q, k <- x / sqrt(sum(x^2) + 1e-6)` (the kernels' in-kernel L2 norm), `q *= d^-1/2`,
  `S = (I - beta k k^T) diag(exp(g)) S + beta k v^T`, `o = S^T q`.

Everything else (projections, the gate `lb * sigmoid(exp(A_log) * (g + dt_bias))` NeMo computes in torch
when a lower bound is set, MLA, AttnRes, the latent MoE, SiTU, MXFP4 decoding, the router) is NeMo's own
code, and the checkpoint reaches it through NeMo's `KimiK3StateDictAdapter.from_hf` from the published
tensor names. The Triton helpers of NeMo's K3 (`attn_res_triton`, `situ_triton`) switch themselves off
without CUDA; no other nemo_automodel import needed a stub (the package imports on CPU as installed).
(A module of tests/ itself, importable by name.)
"""

from __future__ import annotations

import json
from pathlib import Path

import nemo_automodel.components.models.kimi_k3.model as nemo_model
import torch
import torch.nn.functional as F
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.kimi_k3.config import KimiK3Config
from safetensors import safe_open
from torch import nn

L2NORM_EPS = 1e-6  # fla's l2norm_fwd default, used by use_qk_l2norm_in_kernel=True (docs/epsilons.md)


class ShortConvolution(nn.Module):
    """fla.modules.ShortConvolution on CPU: y_t = silu(sum_j w[:, j] x_{t-3+j}) per channel (causal)."""

    def __init__(self, hidden_size: int, kernel_size: int, activation: str, dtype: torch.dtype, **_) -> None:
        super().__init__()
        assert activation == "silu"
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.zeros(hidden_size, 1, kernel_size, dtype=dtype))

    def forward(self, x: torch.Tensor, cache=None, output_final_state=False, cu_seqlens=None, **_):
        assert cache is None and cu_seqlens is None
        B, T, P = x.shape  # x [B, T, P]
        w = self.weight[:, 0, :].double()  # [P, W]
        padded = F.pad(x.double(), (0, 0, self.kernel_size - 1, 0))  # [B, T + W - 1, P]
        y = sum(padded[:, j : j + T] * w[:, j] for j in range(self.kernel_size))
        return F.silu(y).to(x.dtype), None


class FusedRMSNormGated(nn.Module):
    """fla.modules.FusedRMSNormGated(activation="sigmoid") on CPU: rms(o) * weight * sigmoid(gate)."""

    def __init__(self, hidden_size: int, eps: float, activation: str, dtype: torch.dtype, **_) -> None:
        super().__init__()
        assert activation == "sigmoid"
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        o, gate = o.double(), gate.double()  # [B, T, heads, d]
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.double()
        return (normed * torch.sigmoid(gate)).float()


def kda_per_token(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **options):
    """chunk_kda / fused_recurrent_kda on CPU: q, k [B, T, h, d], v [B, T, h, dv], g [B, T, h, d] (log decay),
    beta [B, T, h] -> (o [B, T, h, dv], final state [B, h, d, dv] or None)."""
    assert cu_seqlens is None and options.get("use_qk_l2norm_in_kernel", True)
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
    q = q * q.shape[-1] ** -0.5
    B, T, h, d = q.shape
    S = q.new_zeros(B, h, d, v.shape[-1]) if initial_state is None else initial_state.double().clone()
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # diag(exp(g)) S
        kt, bt = k[:, t], beta[:, t][..., None]  # [B, h, d], [B, h, 1]
        S = (
            S - bt[..., None] * kt[..., None] * torch.einsum("bhd,bhdv->bhv", kt, S)[:, :, None]
        )  # (I - b k k^T)
        S = S + bt[..., None] * kt[..., None] * v[:, t][:, :, None]  # + b k v^T
        out.append(torch.einsum("bhd,bhdv->bhv", q[:, t], S))
    return torch.stack(out, 1).float(), (S.float() if output_final_state else None)


def install_cpu_kernels() -> None:
    """Route NeMo's fla calls to the CPU references above (module globals of NeMo's model.py)."""
    nemo_model.ShortConvolution = ShortConvolution
    nemo_model.FusedRMSNormGated = FusedRMSNormGated
    nemo_model.chunk_kda = kda_per_token
    nemo_model.fused_recurrent_kda = kda_per_token
    nemo_model._SHORT_CONV_OK = nemo_model._FUSED_RMSNORM_GATED_OK = True
    nemo_model._CHUNK_KDA_OK = nemo_model._RECURRENT_KDA_OK = True
    nemo_model._KDA_GATE_OK = True  # its gate: NeMo's own torch path (kda_use_fused_gate=False below)


def published_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every text-model tensor of a checkpoint folder under its published name (the vision tower and its
    projector are left out: NeMo's KimiK3ForCausalLM is the text model; tests/vision holds the tower)."""
    out = {}
    for shard in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            keep = [n for n in f.keys() if not n.startswith(("vision_tower.", "mm_projector."))]
            out.update({name: f.get_tensor(name) for name in keep})
    return out


def nemo_k3(ckpt: Path, config_edits: dict | None = None) -> nemo_model.KimiK3ForCausalLM:
    """NeMo's KimiK3ForCausalLM (fp32, eager attention, eval) with the checkpoint's weights, loaded through
    NeMo's state-dict adapter. `config_edits`: text_config keys to override (the checkpoint's config.json
    is what both sides read otherwise)."""
    install_cpu_kernels()
    raw = json.loads((Path(ckpt) / "config.json").read_text())
    text = raw.get("text_config", raw)
    text.update(config_edits or {})
    text.update(torch_dtype="float32", kda_use_fused_gate=False)
    text.pop("quantization_config", None)  # the adapter decodes MXFP4 pairs itself
    cfg = KimiK3Config(text_config=text, vision_config=None)
    backend = BackendConfig(
        attn="eager", linear="torch", rms_norm="torch", experts="torch", dispatcher="torch"
    )
    model = nemo_model.KimiK3ForCausalLM(cfg, backend=backend).eval()
    native = model.state_dict_adapter.from_hf(published_tensors(ckpt))
    missing, unexpected = model.load_state_dict(native, strict=False)
    missing = [m for m in missing if "e_score_correction_bias" not in m or m not in native]
    if missing or unexpected:
        raise AssertionError(f"NeMo's adapter left missing {missing[:5]} / unexpected {unexpected[:5]}")
    return model


@torch.no_grad()
def nemo_forward(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """ids [B, T] -> logits [B, T, V] and per decoder layer its output: `blocks` [B, T, n, H] (the AttnRes
    blocks closed so far) and `partial` [B, T, H] (the open block), from forward hooks."""
    B, T = ids.shape
    layers: list[dict[str, torch.Tensor]] = []

    def hook(module, args, kwargs, output):
        if isinstance(output, tuple):
            partial, blocks = output
            layers.append({"partial": partial, "blocks": blocks.view(B, T, -1, partial.shape[-1])})
        else:
            layers.append({"partial": output})

    handles = [layer.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers.values()]
    try:
        out = model(ids)
    finally:
        for h in handles:
            h.remove()
    logits = out.logits if hasattr(out, "logits") else out
    return logits.float(), layers
