"""Which weights a checkpoint packs, read from the checkpoint itself: its headers and its quantization_config.

"Packed" is decided per weight by the headers: `X.weight_packed` + `X.weight_scale`, both U8, packed
[out, in/2] and scale [out, in/32] (MXFP4, compressed-tensors' layout). The quantization_config (in
text_config as the release has it, or at the top level) names the format, which must be one k3 implements
(`K3Config` refuses others by name), and an `ignore` list. The list is no promise either way: the release
leaves its router and latent projections unignored yet ships them BF16, and Kimi-K3-0.40B-MXFP4 packs its
shared experts although its card calls them ignored. So the headers decide and the list only explains:

    weight_plan(raw_config, {name: (dtype, shape)})   # {X: PackedWeight(...)} of every packed weight
    ignored_by(quantization_config, "….self_attn.q_proj")   # (k3.config) the matching ignore entry
    with_header_packing(cfg, headers)                 # cfg whose layout packs what the headers pack

The ignore entries match module names (a weight's name without `.weight`) as compressed-tensors matches
them: `re:PATTERN` with `re.match`, anything else by equality.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from k3.checkpoint.source import CheckpointError
from k3.config import K3Config, ignored_by
from k3.layout import MXFP4_BLOCK, classify

Headers = Mapping[str, tuple[str, tuple[int, ...]]]  # tensor name -> (safetensors dtype, shape)
RUNS_PACKED = ("routed_experts", "latent_projections", "shared_experts")  # what k3's model runs in MXFP4


@dataclass(frozen=True)
class PackedWeight:
    module: str  # `X`: the weight's module, `X.weight_packed` + `X.weight_scale` in the checkpoint
    out_features: int
    in_features: int
    component: str  # k3.layout's component of the weight
    ignored_by: str | None  # an ignore entry that matches, though the weight is packed

    @property
    def why(self) -> str:
        shape = f"[{self.out_features}, {self.in_features}]"
        head = f"weight_packed + weight_scale (U8) in the header: MXFP4 {shape}"
        if self.ignored_by is not None:
            return f"{head}; packed although quantization_config ignores it ({self.ignored_by})"
        return f"{head}; not ignored by quantization_config"


def find_quantization_config(raw: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The quantization_config of a raw config.json: text_config's (the release) or the top level's."""
    if not isinstance(raw, Mapping):
        return None
    text = raw.get("text_config")
    for holder in (text, raw):
        if isinstance(holder, Mapping) and isinstance(holder.get("quantization_config"), dict):
            return holder["quantization_config"]
    return None


def weight_plan(
    quantization: Mapping[str, Any] | None, headers: Headers, where: str
) -> dict[str, PackedWeight]:
    """Every packed weight of a checkpoint {module: PackedWeight}, checked: U8, shapes that agree with each
    other. Packed weights without a quantization_config are refused; a half without the other is left to
    the layout check (`match_layout` lists it as missing or unexpected)."""
    plan: dict[str, PackedWeight] = {}
    for name in headers:
        if not name.endswith((".weight_packed", ".weight_scale")):
            continue
        module = name.rsplit(".", 1)[0]
        packed, scale = headers.get(f"{module}.weight_packed"), headers.get(f"{module}.weight_scale")
        if packed is None or scale is None or module in plan:  # a lone half: the layout check lists it
            continue
        if packed[0] != "U8" or scale[0] != "U8":
            raise CheckpointError(
                f"{where}: {module}: packed weights must be U8, got {packed[0]} and {scale[0]}"
            )
        (rows, half_in), (scale_rows, groups) = (
            (tuple(packed[1]) + (0, 0))[:2],
            (tuple(scale[1]) + (0, 0))[:2],
        )
        if (
            len(packed[1]) != 2
            or len(scale[1]) != 2
            or rows != scale_rows
            or 2 * half_in != MXFP4_BLOCK * groups
        ):
            raise CheckpointError(
                f"{where}: {module}: weight_packed {list(packed[1])} and weight_scale {list(scale[1])} "
                f"are not an MXFP4 pair ([out, in/2] and [out, in/{MXFP4_BLOCK}])"
            )
        if quantization is None:
            raise CheckpointError(
                f"{where}: {module} is packed (weight_packed) but config.json has no quantization_config"
            )
        plan[module] = PackedWeight(
            module, rows, 2 * half_in, classify(f"{module}.weight")[0], ignored_by(quantization, module)
        )
    return plan


def with_header_packing(cfg: K3Config, headers: Headers, where: str) -> K3Config:
    """`cfg` with `mxfp4_components` set to what the headers pack (a component is packed in every layer
    or none), so that the layout, the model and the streamed runner expect the checkpoint's own tensors."""
    plan = weight_plan(cfg.quantization, headers, where)
    components = {w.component for w in plan.values()}
    if unsupported := sorted(components - set(RUNS_PACKED)):
        first = next(w.module for w in plan.values() if w.component == unsupported[0])
        raise CheckpointError(
            f"{where}: {first} is packed; k3 runs MXFP4 only for {', '.join(RUNS_PACKED)} (not {unsupported})"
        )
    for component in components - {"routed_experts"}:
        plain = [n for n in headers if n.endswith(".weight") and classify(n)[0] == component]
        if plain:
            raise CheckpointError(
                f"{where}: {component} are packed in some layers, not in others ({plain[0]})"
            )
    ordered = tuple(c for c in RUNS_PACKED if c in components)
    if ordered == cfg.packed_components:
        return cfg
    return dataclasses.replace(cfg, mxfp4_components=ordered)


def packing_rows(quantization: Mapping[str, Any] | None, headers: Headers) -> dict[str, str]:
    """For `k3 inspect`: why each weight is, or is not, packed {tensor name: reason} (matrices only)."""
    plan = weight_plan(quantization, headers, "checkpoint")
    reasons: dict[str, str] = {}
    for name, (dtype, shape) in headers.items():
        module = name.rsplit(".", 1)[0]
        if module in plan:
            reasons[name] = "packed: " + plan[module].why
        elif name.endswith(".weight") and len(shape) == 2 and quantization is not None:
            entry = ignored_by(quantization, module)
            reasons[name] = (
                f"not packed: ignored by {entry}"
                if entry
                else f"not packed: {dtype} in the header (not ignored: the headers decide, not the list)"
            )
    return reasons
