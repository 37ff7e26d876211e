"""Random weights in the published layout, and `init_checkpoint` which writes them as a checkpoint.

Tensors are generated one at a time (each from its own generator, seeded by `(seed, name)`, so a tensor's
values do not depend on which others are generated) and streamed into `save_checkpoint`: memory stays at
about one tensor, which is what lets `k3 init --preset k3-slice` (6.8 B parameters) run in a few GB.

The distributions keep activations finite and O(1) through every layer:
* matrices [out, in]: normal(0, 1/sqrt(in)); matrices writing into the residual stream (o_proj,
  down_proj, w2, routed_expert_up_proj) are further scaled by 1/sqrt(2 * layers);
* embeddings and the vision position grid normal(0, 1); the patch conv normal(0, 1/sqrt(3*P*P));
  norms 1; router bias 0; AttnRes projections normal(0, 1/sqrt(hidden));
* KDA as transformers/fla: A_log = log(uniform(1, 16)), dt_bias = softplus^-1(loguniform(1e-3, 1e-1)),
  short convs uniform(+-1/sqrt(ks)) (nn.Conv1d's default);
* routed experts are drawn in fp32 and quantized to MXFP4 (weight_packed + weight_scale, U8).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from k3.checkpoint import TORCH_DTYPES, save_checkpoint
from k3.checkpoint.public import PUBLIC_LAYOUTS, public_tensors
from k3.checkpoint.writer import atomic_write
from k3.config import K3Config, preset_text
from k3.layout import checkpoint_tensors, published_tensors
from k3.ops.mxfp4 import quantize_mxfp4

_RESIDUAL_WRITERS = (".o_proj.weight", ".down_proj.weight", ".w2.weight", "routed_expert_up_proj.weight")
_ROWS_PER_CHUNK = 4096  # big matrices are drawn in row chunks so that no fp32 copy of them is ever whole


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


def _normal(shape: tuple[int, ...], std: float, out_dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    out = torch.empty(shape, dtype=out_dtype)
    rows = out.view(shape[0], -1)
    for start in range(0, shape[0], _ROWS_PER_CHUNK):
        chunk = rows[start : start + _ROWS_PER_CHUNK]
        chunk.copy_(torch.randn(chunk.shape, generator=gen) * std)
    return out


def draw(
    cfg: K3Config, name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """Initial values of the tensor `name` (logical shape, e.g. an expert's [out, in] before packing)."""
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=dtype)
    if name.endswith(("norm.weight", "layernorm.weight", ".norm0.weight", ".norm1.weight")):
        return torch.ones(shape, dtype=dtype)
    if name.endswith("_res_proj.weight"):
        return _normal(shape, cfg.hidden_size**-0.5, dtype, gen)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log().to(dtype)
    if name.endswith("dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp().clamp_min(1e-4)
        return (dt + torch.log(-torch.expm1(-dt))).to(dtype)  # softplus^-1(dt)
    if name.endswith("conv1d.weight"):
        bound = shape[-1] ** -0.5
        return torch.empty(shape).uniform_(-bound, bound, generator=gen).to(dtype)
    if name.endswith(("embed_tokens.weight", "pos_emb.weight")):
        return _normal(shape, 1.0, dtype, gen)
    if name.endswith("patch_embed.proj.weight"):  # a conv [D, 3, P, P]: fan-in 3*P*P
        return _normal(shape, math.prod(shape[1:]) ** -0.5, dtype, gen)
    std = shape[-1] ** -0.5
    if name.endswith(_RESIDUAL_WRITERS):
        std /= math.sqrt(2 * cfg.num_hidden_layers)
    return _normal(shape, std, dtype, gen)


def random_tensors(
    cfg: K3Config, *, seed: int = 0, layers: int | None = None, vision: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(published name, tensor in the published dtype) for every tensor of the layout, in layout order;
    `vision`: the vision tower and projector too (the checkpoint's last tensors)."""
    pending_scale: tuple[str, torch.Tensor] | None = None
    specs = checkpoint_tensors(cfg, layers=layers) if vision else published_tensors(cfg, layers=layers)
    for spec in specs:
        if spec.name.endswith(".weight_scale"):
            assert pending_scale is not None and pending_scale[0] == spec.name
            yield pending_scale
            pending_scale = None
            continue
        if spec.name.endswith(".weight_packed"):
            logical = spec.name.removesuffix("_packed")  # `...w1.weight`: drawn as a plain matrix
            shape = (spec.shape[0], 2 * spec.shape[1])
            packed, scale = quantize_mxfp4(
                draw(cfg, logical, shape, torch.float32, _generator(seed, logical))
            )
            yield spec.name, packed
            pending_scale = (spec.name.removesuffix("_packed") + "_scale", scale)
            continue
        yield (
            spec.name,
            draw(cfg, spec.name, spec.shape, TORCH_DTYPES[spec.dtype], _generator(seed, spec.name)),
        )


def init_checkpoint(
    cfg: K3Config,
    out_dir: str | Path,
    seed: int = 0,
    *,
    max_shard_size: int = 2 * 10**9,
    extra_files: dict[str, bytes] | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write a random checkpoint of `cfg` in the published layout; returns the files written.

    `extra_files`: more files for the directory (name -> bytes, e.g. a tokenizer), written after the
    weights. The checkpoint always has the sharded form (shards + model.safetensors.index.json).
    """
    out = Path(out_dir)
    files = save_checkpoint(
        random_tensors(cfg, seed=seed, vision=True),
        cfg,
        out,
        max_shard_size=max_shard_size,
        always_index=True,
        overwrite=overwrite,
    )
    for name, data in (extra_files or {}).items():
        if Path(name).name != name:
            raise ValueError(f"extra file names must be plain file names, got {name!r}")
        (out / name).write_bytes(data)
        files.append(out / name)
    return files


# Tokens the 0.40B tokenizers add past the 163,840-row vocabulary (K2's): their added_tokens.json as
# published (200 B, sha256 27373c2f…)
K2_ADDED_TOKENS = {
    "<|im_end|>": 163840,
    "<|im_user|>": 163841,
    "<|im_assistant|>": 163842,
    "<|start_header_id|>": 163843,
    "<|end_header_id|>": 163844,
    "<|im_system|>": 163845,
    "<|im_middle|>": 163846,
}


def init_like(name: str, out_dir: str | Path, seed: int = 0, *, overwrite: bool = False) -> list[Path]:
    """Write a random checkpoint in the layout of the public checkpoint `name` (k3.checkpoint.public):
    its config.json byte for byte, its tensor names, shapes and dtypes, its file names and index."""
    layout = PUBLIC_LAYOUTS[name]
    cfg = layout.config()
    dtypes = {spec.name: spec.dtype for spec in public_tensors(layout)}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:  # text model, then the vision tower + projector
        for tensor_name, tensor in random_tensors(cfg, seed=seed, vision=True):
            yield tensor_name, tensor.to(TORCH_DTYPES[dtypes[tensor_name]])

    out = Path(out_dir)
    files = save_checkpoint(
        tensors(),
        None,
        out,
        max_shard_size=None if layout.single_file else 5 * 10**9,
        always_index=not layout.single_file,
        overwrite=overwrite,
    )
    atomic_write(out / "config.json", preset_text(name).encode())
    files.append(out / "config.json")
    if layout.all_f32:  # the 0.40B family's tokenizers: K2 tokens past the vocabulary
        atomic_write(
            out / "added_tokens.json", (json.dumps(K2_ADDED_TOKENS, indent=2, sort_keys=True) + "\n").encode()
        )
        files.append(out / "added_tokens.json")
    return files
