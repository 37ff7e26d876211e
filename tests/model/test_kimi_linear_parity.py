"""External oracle: transformers' KimiLinearForCausalLM, saved with save_pretrained, loaded into k3."""

from __future__ import annotations

import pytest
import torch
import transformers

from k3.model import K3ForCausalLM


def tiny_kimi_linear(q_lora_rank: int | None, n_group: int) -> transformers.KimiLinearForCausalLM:
    cfg = transformers.KimiLinearConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=32,
        num_hidden_layers=5,
        layer_types=[
            "linear_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ],
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
    with (
        torch.no_grad()
    ):  # move every weight off its default (norms = 1, router bias = 0, ...) so that all matter
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("A_log") or name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
            else:
                p.mul_(3.0)  # transformers' 0.02 init leaves everything close to linear
    return model


@pytest.mark.parametrize("q_lora_rank,n_group", [(None, 1), (16, 2)])
def test_logits_match_transformers(tmp_path, q_lora_rank, n_group):
    oracle = tiny_kimi_linear(q_lora_rank, n_group)
    oracle.save_pretrained(tmp_path)
    ids = torch.randint(0, 96, (2, 77), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = oracle(ids).logits
        ours = K3ForCausalLM.from_pretrained(tmp_path)(ids)
    scale = expected.abs().max()
    assert scale > 1.0
    assert (ours - expected).abs().max() <= 1e-4 * scale


def test_truncated_load_matches_transformers_with_fewer_layers(tmp_path):
    oracle = tiny_kimi_linear(None, 1)
    oracle.save_pretrained(tmp_path)
    oracle.model.layers = oracle.model.layers[:3]
    oracle.config.num_hidden_layers = 3
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = oracle(ids).logits
        ours = K3ForCausalLM.from_pretrained(tmp_path, layers=3)(ids)
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()
