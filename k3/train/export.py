"""Export a trained model as a checkpoint in the published layout: routed experts MXFP4, the rest BF16/F32.

Experts train as plain fp32 matrices; here each `w1`/`w3`/`w2` is quantized once with
`k3.ops.mxfp4.quantize_mxfp4` into `weight_packed` + `weight_scale` (U8). Every other tensor is cast to
the dtype the layout names (BF16, or F32 for the KDA vectors and `e_score_correction_bias`, which holds
the balance bias the training learned). A tokenizer is written beside the weights (the one given, or the
built-in BPE of the model's vocabulary size), so `k3 generate` and `k3 atlas` open the folder as is.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from k3.config import K3Config

_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}


def mxfp4_config(cfg: K3Config) -> K3Config:
    """`cfg` with the published MXFP4 quantization_config (taken from the `tiny` preset) if it has none."""
    if cfg.experts_mxfp4:
        return cfg
    preset = json.loads(resources.files("k3").joinpath("presets", "tiny.json").read_text())
    out = copy.deepcopy(cfg)
    out.quantization_config = preset["text_config"]["quantization_config"]
    out.validate()
    return out


def published_state(
    model: nn.Module, cfg: K3Config, state: Mapping[str, torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(published name, tensor) for every tensor of the layout, from a model with plain experts, or from
    `state` (its tensors by model name, e.g. a checkpoint that several ranks wrote) when given."""
    from k3.layout import published_tensors
    from k3.model.loading import model_name
    from k3.ops.mxfp4 import quantize_mxfp4

    state = model.state_dict() if state is None else state
    scale = None
    for spec in published_tensors(cfg, layers=len(model.model.layers)):
        if spec.name.endswith(".weight_scale"):
            yield spec.name, scale
            continue
        if spec.name.endswith(".weight_packed"):
            weight = state[model_name(cfg, spec.name.removesuffix("_packed"))]  # `...w1.weight`, [out, in]
            packed, scale = quantize_mxfp4(weight.detach().float())
            yield spec.name, packed
            continue
        tensor = state[model_name(cfg, spec.name)].detach()
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{spec.name}: the model holds {list(tensor.shape)}, the layout {list(spec.shape)}"
            )
        yield spec.name, tensor.to(_DTYPES[spec.dtype]).contiguous()


def export_checkpoint(
    model: nn.Module,
    cfg: K3Config,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    state: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write the model (or `state`, see `published_state`) to `out_dir` (replacing an earlier export) with
    experts in MXFP4; returns out_dir."""
    from k3.checkpoint import save_checkpoint

    out = Path(out_dir)
    cfg = mxfp4_config(cfg)
    save_checkpoint(published_state(model, cfg, state), cfg, out, overwrite=True)
    if tokenizer_dir is not None:
        for name in ("tiktoken.model", "tokenizer_config.json"):
            shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    else:
        from k3.tokenizer.build import write_tokenizer

        write_tokenizer(out, cfg.vocab_size)
    return out
