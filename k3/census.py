"""The parameter census: how many parameters and bytes each part of a K3-family model holds.

From a config the census walks the published layout (`k3.layout`) with each layer's routed experts counted
once and multiplied, so the full 2.78 T model answers in milliseconds and allocates nothing. From a
checkpoint it counts the safetensors headers alone and reports where they disagree with the config.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from k3.config import FFN, ConfigError, K3Config, Mixer
from k3.layout import (
    COMPONENTS,
    DTYPE_BYTES,
    VISION_COMPONENTS,
    checkpoint_tensors,
    classify,
    parameters_of,
    prefixes,
    published_tensors,
    vision_tensors,
)


@dataclass
class Census:
    config: K3Config
    components: dict[str, int]  # parameters per component
    disk_bytes_by_format: dict[str, int]  # "MXFP4", "BF16", "F32", ...
    layer_params: list[int]  # parameters per layer (index 0-based)
    source: str = "config"
    findings: list[str] = field(default_factory=list)  # disagreements between checkpoint and config
    other_params: int = 0  # tensors outside the text model and the vision path
    # the vision tower and projector (a config with vision_config): parameters per part, outside `components`
    vision: dict[str, int] = field(default_factory=lambda: dict.fromkeys(VISION_COMPONENTS, 0))

    # ---- headline figures ---------------------------------------------------------------------------------
    @property
    def total_params(self) -> int:
        return sum(self.components.values())

    @property
    def vision_params(self) -> int:
        return sum(self.vision.values())

    @property
    def params_per_expert_matrix(self) -> int:
        return self.config.moe_intermediate_size * self.config.expert_input_size

    @property
    def params_per_expert(self) -> int:
        return 3 * self.params_per_expert_matrix

    @property
    def routed_experts(self) -> int:
        return self.config.num_moe_layers * self.config.num_experts

    @property
    def active_params(self) -> int:
        """Parameters that run for one token: top-k of the routed experts and everything else except the
        input embedding, which is a lookup."""
        c, cfg = self.components, self.config
        routed_active = 0
        if cfg.num_experts:
            routed_active = c["routed_experts"] * cfg.num_experts_per_token // cfg.num_experts
        return self.total_params - c["embedding"] - c["routed_experts"] + routed_active

    @property
    def disk_bytes(self) -> int:
        return sum(self.disk_bytes_by_format.values())

    def params_by_layer_kind(self) -> dict[str, dict[str, int]]:
        """{"KDA+MoE": {"layers": n, "params": p}, ...}"""
        kinds: dict[str, dict[str, int]] = defaultdict(lambda: {"layers": 0, "params": 0})
        for plan, params in zip(self.config.layer_plan, self.layer_params, strict=True):
            kind = f"{plan.mixer.name}+{'MoE' if plan.ffn is FFN.MOE else 'dense'}"
            kinds[kind]["layers"] += 1
            kinds[kind]["params"] += params
        return dict(kinds)

    def to_json(self) -> dict[str, Any]:
        cfg = self.config
        plan = cfg.layer_plan
        return {
            "source": self.source,
            "total_params": self.total_params,
            "active_params": self.active_params,
            "active_fraction": self.active_params / self.total_params,
            "layers": cfg.num_hidden_layers,
            "kda_layers": sum(p.mixer is Mixer.KDA for p in plan),
            "mla_layers": sum(p.mixer is Mixer.MLA for p in plan),
            "moe_layers": cfg.num_moe_layers,
            "dense_layers": sum(p.ffn is FFN.DENSE for p in plan),
            "experts_per_layer": cfg.num_experts,
            "experts_per_token": cfg.num_experts_per_token,
            "shared_experts_per_layer": cfg.num_shared_experts,
            "routed_experts": self.routed_experts,
            "params_per_expert": self.params_per_expert,
            "params_per_expert_matrix": self.params_per_expert_matrix,
            "dense_mlp_params": self.components["dense_mlp"],
            "expert_params": self.components["routed_experts"] + self.components["shared_experts"],
            "disk_bytes": self.disk_bytes,
            "disk_bytes_by_format": self.disk_bytes_by_format,
            "components": self.components,
            "layer_kinds": self.params_by_layer_kind(),
            "layer_params": self.layer_params,
            "other_params": self.other_params,
            "vision_params": self.vision_params,
            "vision_components": self.vision,
            "findings": self.findings,
        }


def _storage_format(name: str, dtype: str) -> str:
    return "MXFP4" if name.endswith((".weight_packed", ".weight_scale")) else dtype


def census_from_config(cfg: K3Config) -> Census:
    components = dict.fromkeys(COMPONENTS, 0)
    disk: dict[str, int] = defaultdict(int)
    layer_params = [0] * cfg.num_hidden_layers
    for t in published_tensors(cfg, expand_experts=False):
        components[t.component] += t.params
        disk[_storage_format(t.name, t.dtype)] += t.nbytes
        if t.layer is not None:
            layer_params[t.layer] += t.params
    vision = dict.fromkeys(VISION_COMPONENTS, 0)
    for t in vision_tensors(cfg):
        vision[t.component] += t.params
        disk[t.dtype] += t.nbytes
    return Census(cfg, components, dict(disk), layer_params, vision=vision)


def census_from_headers(
    cfg: K3Config, tensors: Iterable[tuple[str, str, tuple[int, ...]]], source: str
) -> Census:
    """Census of a checkpoint from its headers: (name, safetensors dtype, shape) per tensor."""
    components = dict.fromkeys(COMPONENTS, 0)
    disk: dict[str, int] = defaultdict(int)
    layer_params = [0] * cfg.num_hidden_layers
    other = 0
    vision = dict.fromkeys(VISION_COMPONENTS, 0)
    model_prefix, lm_head = prefixes(cfg)
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, dtype, shape in tensors:
        numel = math.prod(shape)
        params = parameters_of(name, dtype, numel)
        disk[_storage_format(name, dtype)] += numel * DTYPE_BYTES.get(dtype, 0)
        if (part := classify(name, cfg)[0]) in VISION_COMPONENTS:
            vision[part] += params
            found[name] = (dtype, tuple(shape))
            continue
        if not (name.startswith(model_prefix) or name == lm_head):
            other += params
            continue
        found[name] = (dtype, tuple(shape))
        component, layer = classify(name, cfg)
        if component == "other":
            other += params
            continue
        components[component] += params
        if layer is not None and layer < cfg.num_hidden_layers:
            layer_params[layer] += params
    census = Census(
        cfg, components, dict(disk), layer_params, source=source, other_params=other, vision=vision
    )
    census.findings = _compare_with_config(cfg, found)
    return census


def _compare_with_config(cfg: K3Config, found: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """Names missing, unexpected or mis-shaped against the published layout (first few of each)."""
    expected = {t.name: t.shape for t in checkpoint_tensors(cfg)}
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected]
    misshaped = [
        f"{n}: {found[n][1]} in the checkpoint, {s} from the config"
        for n, s in expected.items()
        if n in found and found[n][1] != s
    ]
    findings = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
        if names:
            more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
            findings.append(f"{len(names)} {label} tensor(s) vs config: {', '.join(names[:5])}{more}")
    return findings


def census_of(target: str) -> Census:
    """Census of a preset name, a config.json, or a checkpoint (directory or http(s) URL).

    A checkpoint is counted from its safetensors headers (no tensor data is read).
    """
    from pathlib import Path

    from k3.config import PRESETS, PUBLIC_PRESETS, no_such_source

    if target in PRESETS + PUBLIC_PRESETS:
        return census_from_config(K3Config.preset(target))
    path = Path(target)
    if path.is_file():
        return census_from_config(K3Config.from_json(path))
    if "://" not in target and not path.exists():
        raise no_such_source(target)
    from k3.checkpoint import open_checkpoint  # the checkpoint layer knows nothing of the census

    with open_checkpoint(target) as ckpt:
        if ckpt.config is None:
            raise ConfigError(f"{target}: no K3-family config to count against ({ckpt.config_error})")
        headers = [(t.name, t.dtype, t.shape) for t in ckpt.tensors()]
        return census_from_headers(ckpt.config, headers, source=target)
