"""Optional modules follow explicit flags: each flag on or off gives exactly the published tensor names of
k3.layout (written from K3.md section 3, independently of the model), and the flags say which."""

from __future__ import annotations

import dataclasses

import pytest

from k3.config import K3Config
from k3.layout import prefixes, published_tensors
from k3.model import K3ForCausalLM
from k3.model.mla import MLAttention
from k3.model.moe import MoE

VARIANTS = {
    "tiny": {},
    "no AttnRes": {"attn_res_block_size": None},
    "single q_proj": {"q_lora_rank": None},
    "no latent norm": {"latent_moe_use_norm": False},
    "no shared experts": {"num_shared_experts": 0},
    "no latent MoE": {"routed_expert_hidden_size": None},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_parameters_are_the_published_names_for_every_flag(variant):
    cfg = dataclasses.replace(K3Config.preset("tiny"), **VARIANTS[variant])
    model = K3ForCausalLM(cfg)
    model_prefix, lm_head = prefixes(cfg)
    published = {
        "lm_head.weight" if t.name == lm_head else "model." + t.name.removeprefix(model_prefix)
        for t in published_tensors(cfg)
    }
    assert set(model.state_dict()) == published
    layer = model.model.layers[-1]
    mla = next(m for m in model.modules() if isinstance(m, MLAttention))
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert layer.uses_attn_res is model.model.uses_attn_res is (cfg.attn_res_block_size is not None)
    assert mla.q_lora is (cfg.q_lora_rank is not None)
    assert moe.latent is (cfg.routed_expert_hidden_size is not None)
    assert moe.latent_norm is (moe.latent and cfg.latent_moe_use_norm)
    assert moe.shared is (cfg.num_shared_experts > 0)
