"""The two epsilons where engines part (docs/epsilons.md), pinned per architecture with small-input norms.

With the inputs of a norm scaled by 1e-3, mean(x^2) is of the order of eps itself, so 1e-6 and 1e-5 give
visibly different logits. Each test (1) checks k3 against an independent oracle that uses the eps of the
architecture's reference code, and (2) shows that the oracle run with the other eps (rms_norm_eps, 1e-5,
llama.cpp's choice) lands far outside the tolerance: the check fails if k3 used the other eps.

K3: the float64 reference of tests/model/model_reference.py (Moonshot's K3 code: 1e-6 for both).
Kimi Linear: transformers' KimiLinearForCausalLM (1e-6 for both, as Moonshot's Kimi Linear code).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from model_reference import ReferenceK3
from safetensors import safe_open

from k3.checkpoint import save_checkpoint
from k3.config import ConfigError, K3Config
from k3.model import K3ForCausalLM

OTHER_EPS = 1e-5  # rms_norm_eps of every K3 / Kimi Linear config, llama.cpp's value for both norms
SCALED = {  # which norm's inputs are shrunk by 1e-3: the MLA latents, or the KDA q and k
    "mla_latent": r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$",
    "kda_l2": r"self_attn\.(q_proj|k_proj)\.weight$",
}


def scaled_copy(src, dst, pattern: str) -> None:
    rx = re.compile(pattern)

    def tensors():
        for shard in sorted(src.glob("*.safetensors")):
            with safe_open(shard, "pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    yield name, ((t.float() * 1e-3).to(t.dtype) if rx.search(name) else t)

    save_checkpoint(tensors(), K3Config.from_pretrained(src), dst, always_index=True)


def with_eps(model: K3ForCausalLM, **eps: float) -> K3ForCausalLM:
    """The same weights in a model built from a config with other epsilons."""
    other = K3ForCausalLM(dataclasses.replace(model.config, **eps))
    other.load_state_dict(model.state_dict())
    return other.eval()


@pytest.mark.parametrize("which", sorted(SCALED))
def test_k3_epsilons_follow_the_reference(tiny_checkpoint, tmp_path, which):
    scaled_copy(tiny_checkpoint, tmp_path, SCALED[which])
    ids = torch.randint(0, 1024, (1, 24), generator=torch.Generator().manual_seed(5))
    model = K3ForCausalLM.from_pretrained(tmp_path)
    field = "mla_latent_norm_eps" if which == "mla_latent" else "kda_l2norm_eps"
    assert getattr(model.config, field) == 1e-6
    with torch.no_grad():
        ours = model(ids)[0].double()
        ours_other = with_eps(model, **{field: OTHER_EPS})(ids)[0].double()
    key = "latent_norm_eps" if which == "mla_latent" else "l2norm_eps"
    expected = ReferenceK3(tmp_path).logits(ids[0].tolist())
    expected_other = ReferenceK3(tmp_path, **{key: OTHER_EPS}).logits(ids[0].tolist())
    tol = 1e-4 * expected.abs().max()
    assert (ours - expected).abs().max() <= tol
    assert (ours_other - expected_other).abs().max() <= tol  # the field is what the model uses
    assert (expected_other - expected).abs().max() > 100 * tol  # the eps matters at these inputs


def small_input_kimi_linear(which: str):
    from kimi_linear_oracle import tiny_kimi_linear

    model = tiny_kimi_linear(16, 1)  # q_lora_rank 16: both latent norms
    rx = re.compile(SCALED[which])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if rx.search(name):
                p.mul_(1e-3)
    return model


@pytest.mark.parametrize("which", sorted(SCALED))
def test_kimi_linear_epsilons_follow_transformers(tmp_path, which):
    oracle = small_input_kimi_linear(which)
    oracle.save_pretrained(tmp_path)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(4))
    field = "mla_latent_norm_eps" if which == "mla_latent" else "kda_l2norm_eps"
    model = K3ForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        expected = oracle(ids).logits[0].double()
        ours = model(ids)[0].double()
        ours_other = with_eps(model, **{field: OTHER_EPS})(ids)[0].double()
    tol = 1e-4 * expected.abs().max()
    assert (ours - expected).abs().max() <= tol
    assert (ours_other - expected).abs().max() > 100 * tol


def test_the_epsilons_travel_in_config_json_only_when_set():
    raw = K3Config.preset("tiny").to_dict()
    assert "mla_latent_norm_eps" not in raw["text_config"] and "kda_l2norm_eps" not in raw["text_config"]
    raw["text_config"].update(mla_latent_norm_eps=1e-5, kda_l2norm_eps=2e-5)
    cfg = K3Config.from_dict(raw)
    assert (cfg.mla_latent_norm_eps, cfg.kda_l2norm_eps) == (1e-5, 2e-5)
    assert K3Config.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="kda_l2norm_eps"):
        dataclasses.replace(cfg, kda_l2norm_eps=0.0)
