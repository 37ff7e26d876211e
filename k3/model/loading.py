"""Loading a checkpoint into `K3ForCausalLM`: strict name/shape checks, then weights in place.

The model is built on the meta device (no memory), each tensor is read from the memory-mapped shards
(`k3.checkpoint`, zero-copy locally) and becomes the parameter itself: resident memory is the checkpoint's
pages that the model uses, plus conversions when a `dtype` is asked for. From a URL the shards are mirrored
into sparse local files that the tensors are mapped from (`k3.checkpoint.mirror`): the dense weights are
fetched at load, each routed expert when a router first chooses it (`k3.model.on_demand`).

Accepted layouts: K3 (`language_model.` prefix), Kimi Linear (no prefix), and what
`transformers.KimiLinearForCausalLM.save_pretrained` writes (5.23.0: the published names, except that it
renames the dense layer's `mlp.` to `block_sparse_moe.`, the reverse of its own load-time renaming; and
F32 everywhere: floating dtypes may differ from the published ones, packed MXFP4 must be U8).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from k3.checkpoint import open_checkpoint
from k3.checkpoint.reader import is_url
from k3.checkpoint.traps import warn_traps
from k3.config import FFN, K3Config
from k3.errors import K3Error
from k3.layout import TensorSpec, prefixes, published_tensors, vision_tensors
from k3.model.on_demand import ExpertsOnDemand, expert_of

_LAYER = re.compile(r"\blayers\.(\d+)\.")
_TRANSFORMERS_DENSE = re.compile(r"^(.*layers\.(\d+)\.)block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")
_LIST_AT_MOST = 12
# The model class loaded into (K3ForCausalLM: k3.model.model calls in here, never the other way round).
Model = TypeVar("Model", bound=nn.Module)
VISION_PREFIXES = ("vision_tower.", "mm_projector.")


class ModelLoadError(K3Error):
    """A checkpoint that does not match the model's layout; the message lists every mismatch."""


def model_name(cfg: K3Config, published: str) -> str:
    """Published tensor name -> parameter name in K3ForCausalLM (`model.…`, `lm_head.weight`)."""
    model_prefix, lm_head = prefixes(cfg)
    if published == lm_head:
        return "lm_head.weight"
    if published.startswith(VISION_PREFIXES):
        return published  # the multimodal model's own `vision_tower.…`, `mm_projector.…`
    if not published.startswith(model_prefix):
        raise ModelLoadError(f"{published}: not a tensor of the text model")
    return "model." + published[len(model_prefix) :]


def _canonical(cfg: K3Config, name: str) -> str:
    """A checkpoint name in the published spelling (undoing transformers' renaming of the dense MLP)."""
    m = _TRANSFORMERS_DENSE.match(name)
    if m and int(m.group(2)) < cfg.num_hidden_layers and cfg.layer_plan[int(m.group(2))].ffn is FFN.DENSE:
        return f"{m.group(1)}mlp.{m.group(3)}"
    return name


def _listing(title: str, items: list[str]) -> str:
    shown = items[:_LIST_AT_MOST]
    more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"  {title} ({len(items)}):\n" + "\n".join(f"    {s}" for s in shown) + more


def match_layout(
    cfg: K3Config, found: dict[str, tuple[str, tuple[int, ...]]], layers: int, where: str
) -> dict[str, str]:
    """Check a checkpoint's tensors {name: (dtype, shape)} against the layout of the first `layers` layers.

    Returns {published name: checkpoint name}. Raises ModelLoadError listing the missing, unexpected,
    mis-shaped and wrongly typed tensors. Tensors outside the text model (a vision tower) and those of
    layers beyond `layers` (a depth-truncated load) are skipped.
    """
    expected: dict[str, TensorSpec] = {s.name: s for s in published_tensors(cfg, layers=layers)}
    model_prefix, lm_head = prefixes(cfg)
    by_canonical: dict[str, str] = {}
    unexpected: list[str] = []
    for name in found:
        canonical = _canonical(cfg, name)
        if canonical in expected:
            by_canonical[canonical] = name
            continue
        if canonical != lm_head and not canonical.startswith(model_prefix):
            continue  # not the text model
        m = _LAYER.search(canonical)
        if m and layers <= int(m.group(1)) < cfg.num_hidden_layers:
            continue  # a layer left out by `layers=N`
        unexpected.append(name)
    missing = [n for n in expected if n not in by_canonical]
    misshaped, mistyped = [], []
    for published, name in by_canonical.items():
        spec = expected[published]
        dtype, shape = found[name]
        unpadded = published.endswith(".A_log") and tuple(shape) == (cfg.kda_num_heads,)  # one per head
        if tuple(shape) != spec.shape and not unpadded:
            misshaped.append(f"{name}: {list(shape)} in the checkpoint, {list(spec.shape)} expected")
        packed = spec.dtype == "U8"
        if packed and dtype != "U8" or not packed and dtype not in ("F32", "BF16", "F16", "F64"):
            mistyped.append(f"{name}: {dtype} in the checkpoint, {spec.dtype} expected")
    if missing or unexpected or misshaped or mistyped:
        parts = [
            _listing(title, items)
            for title, items in (
                ("missing", missing),
                ("unexpected", sorted(unexpected)),
                ("mis-shaped", misshaped),
                ("wrong dtype", mistyped),
            )
            if items
        ]
        raise ModelLoadError(
            f"{where}: the checkpoint does not match the layout of its config "
            f"({layers} of {cfg.num_hidden_layers} layers):\n" + "\n".join(parts)
        )
    return by_canonical


def match_vision(cfg: K3Config, found: dict[str, tuple[str, tuple[int, ...]]], where: str) -> dict[str, str]:
    """The vision path's tensors {name: name}, checked against `vision_tensors(cfg)` as match_layout does:
    ModelLoadError names each missing, unexpected, mis-shaped or wrongly typed tensor."""
    if cfg.vision_config is None:
        raise ModelLoadError(f"{where}: the config has no vision_config (a text-only checkpoint)")
    expected = {s.name: s for s in vision_tensors(cfg)}
    have = {n for n in found if n.startswith(VISION_PREFIXES)}
    missing = [n for n in expected if n not in have]
    unexpected = sorted(have - set(expected))
    misshaped = [
        f"{n}: {list(found[n][1])} in the checkpoint, {list(s.shape)} expected"
        for n, s in expected.items()
        if n in have and tuple(found[n][1]) != s.shape
    ]
    mistyped = [
        f"{n}: {found[n][0]} in the checkpoint, BF16 expected"
        for n in expected
        if n in have and found[n][0] not in ("F32", "BF16", "F16", "F64")
    ]
    items = [
        ("missing", missing),
        ("unexpected", unexpected),
        ("mis-shaped", misshaped),
        ("wrong dtype", mistyped),
    ]
    if any(found_ for _, found_ in items):
        parts = [_listing(title, names) for title, names in items if names]
        raise ModelLoadError(
            f"{where}: the vision tower does not match its vision_config:\n" + "\n".join(parts)
        )
    return {n: n for n in expected}


def assign_tensor(model: nn.Module, name: str, tensor: torch.Tensor, *, requires_grad: bool = True) -> None:
    """Make `tensor` the parameter or buffer `name` of `model` (no copy); a floating parameter is trainable
    only with `requires_grad` (inference: no gradient, so no autograd keeps copies of weights)."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    if attr in module._parameters:  # registered, so that torch's registration hooks see it (fused.DecodePlan)
        module.register_parameter(
            attr, nn.Parameter(tensor, requires_grad=requires_grad and tensor.is_floating_point())
        )
    elif attr in module._buffers:
        module.register_buffer(attr, tensor, persistent=attr not in module._non_persistent_buffers_set)
    else:
        raise ModelLoadError(f"{name}: the model has no such parameter or buffer")


def load_model(
    cls: type[Model],
    source: str | Path,
    *,
    dtype: torch.dtype | None,
    layers: int | None,
    compute_dtype: torch.dtype | None,
    requires_grad: bool = False,
    mirror_dir: Path | None = None,
) -> Model:
    remote = is_url(source)
    mirror = Path(mirror_dir or tempfile.gettempdir()) if remote else None
    ckpt = open_checkpoint(source, mirror=mirror)
    try:
        cfg = ckpt.config
        if cfg is None:
            raise ModelLoadError(f"{ckpt.location}: no usable config.json ({ckpt.config_error})")
        warn_traps(ckpt.traps, ckpt.location)
        n = cfg.num_hidden_layers if layers is None else layers
        if not 1 <= n <= cfg.num_hidden_layers:
            raise ModelLoadError(f"layers must be in 1..{cfg.num_hidden_layers}, got {layers}")
        found = {t.name: (t.dtype, tuple(t.shape)) for t in ckpt.tensors()}
        names = match_layout(cfg, found, n, str(source))
        specs = {s.name: s for s in published_tensors(cfg, layers=n)}
        if getattr(cls, "loads_vision", False):
            names.update(match_vision(cfg, found, str(source)))
            specs.update({s.name: s for s in vision_tensors(cfg)})
        with torch.device("meta"):
            model = cls(cfg, num_layers=n, compute_dtype=compute_dtype or dtype or torch.float32)

        def convert(published: str, tensor: torch.Tensor) -> torch.Tensor:
            if dtype is not None and tensor.is_floating_point() and specs[published].dtype != "F32":
                return tensor.to(dtype)
            return tensor

        def assign(path: str, tensor: torch.Tensor) -> None:
            assign_tensor(model, path, tensor, requires_grad=requires_grad)

        later: dict[tuple[int, int], list[tuple[str, str, str]]] = {}  # routed experts, read on first use
        now: list[tuple[str, str, str]] = []
        for published, name in names.items():
            path = model_name(cfg, published)
            expert = expert_of(path) if remote else None
            (later.setdefault(expert, []) if expert is not None else now).append((path, published, name))
        ckpt.prefetch([name for _, _, name in now])  # a mirrored checkpoint: the dense bytes in one pass
        for path, published, name in now:
            assign(path, convert(published, ckpt.read(name)))
        if later:
            ExpertsOnDemand(model, ckpt, later, convert, assign)
    except BaseException:
        ckpt.close()
        raise
    if not later:
        ckpt.close()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.source = ckpt.location  # a Hub source pinned: hf://ORG/REPO@<commit> (its tokenizer: the same)
    waiting = {path for tensors in later.values() for path, _, _ in tensors}
    left = [
        k for k, v in [*model.named_parameters(), *model.named_buffers()] if v.is_meta and k not in waiting
    ]
    if left:
        raise ModelLoadError(
            f"{source}: the model has tensors the layout does not cover: {left[:_LIST_AT_MOST]}"
        )
    return model.eval()
