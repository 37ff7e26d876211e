"""Loading and saving the policy the RL loop trains: plain fp32 weights (experts unquantised).

`--init` may name a preset (random weights, `k3 init`'s for the seed), a checkpoint in the published
layout (MXFP4 experts are dequantised exactly), or a policy folder written here (`config.json` +
`policy.safetensors`, the state dict as training holds it: what `k3 rl sft` writes)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from k3.config import K3Config
from k3.errors import K3Error

POLICY_FILE = "policy.safetensors"
CONFIG_FILE = "config.json"


class PolicyError(K3Error):
    """A model source (`--init`, `--student`, a teacher) that is no preset, checkpoint or policy folder."""


def load_policy(init: str, seed: int = 0, option: str = "--init"):
    """The model named by `init` (see module doc), fp32, experts as plain trainable weights; errors name
    `init` as the command-line `option` that gave it."""
    from k3.model import K3ForCausalLM

    path = Path(init)
    if (path / POLICY_FILE).is_file():
        cfg = K3Config.from_pretrained(str(path / CONFIG_FILE))
        model = K3ForCausalLM.from_config(cfg, seed=seed, quantized_experts=False)
        model.load_state_dict(load_file(str(path / POLICY_FILE)), strict=True)
        return model
    if path.is_dir():
        try:
            model = K3ForCausalLM.from_pretrained(path, dtype=torch.float32)
        except Exception as e:
            raise PolicyError(f"{option} {init}: {e}") from None
        return model.dequantize_experts(torch.float32)
    try:
        cfg = K3Config.from_pretrained(init)
    except Exception as e:
        raise PolicyError(f"{option} {init}: not a preset, checkpoint or policy folder ({e})") from None
    return K3ForCausalLM.from_config(cfg, seed=seed, quantized_experts=False)


def save_policy(model, out: str | Path) -> Path:
    """Write `config.json` + `policy.safetensors` (atomically: temporary names, then renamed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{POLICY_FILE}.tmp"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(tmp))
    model.config.save(out / CONFIG_FILE)
    tmp.replace(out / POLICY_FILE)
    return out
