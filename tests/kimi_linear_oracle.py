"""The transformers oracle the Kimi Linear tests share: a small `KimiLinearForCausalLM` with every weight
moved off its default. (A module of tests/ itself, beside the root conftest.py, importable by name.)"""

from __future__ import annotations

import torch
import transformers

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]


def tiny_kimi_linear(
    q_lora_rank: int | None = 16, n_group: int = 1, num_layers: int = 5
) -> transformers.KimiLinearForCausalLM:
    """A small KimiLinearForCausalLM, layers KDA, KDA, MLA, KDA, MLA (the first `num_layers` of them), with
    every weight moved off its default (norms = 1, router bias = 0, ...) so that all of them matter."""
    cfg = transformers.KimiLinearConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=32,
        num_hidden_layers=num_layers,
        layer_types=LAYER_TYPES[:num_layers],
        first_k_dense_replace=1,
        num_local_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=1,
        n_group=n_group,
        topk_group=1,
        routed_scaling_factor=2.446,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        linear_num_heads=2,
        linear_head_dim=16,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("A_log") or name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
            else:
                p.mul_(3.0)  # transformers' 0.02 init leaves everything close to linear
    return model
