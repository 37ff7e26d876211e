"""External oracle: transformers' KimiLinearForCausalLM, saved with save_pretrained, loaded into k3."""

from __future__ import annotations

import pytest
import torch
from kimi_linear_oracle import tiny_kimi_linear

from k3.model import K3ForCausalLM


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
