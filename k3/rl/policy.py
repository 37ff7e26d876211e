"""The trainer's view of rollouts: one teacher-forced forward over many trajectories, its token log-probs,
routing replay, and the engine/trainer consistency figures.

A batch of N trajectories is packed right-padded: row b holds prompt + tokens[:-1] (the positions the
engine fed), so logits at position len(prompt) - 1 + j predict tokens[j]. The model is causal (MLA masks,
KDA and its short convolution run left to right), so padding after a row's end changes none of its
logits. Log-probs are those of the distribution sampled from: log_softmax(logits / T). Tokens a tool
inserted (`Trajectory.env`) are fed like any other but have mask 0: no loss, no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3.model.routing import record_routing, route_with
from k3.rl.rollout import Trajectory


@dataclass
class Packed:
    inputs: torch.Tensor  # [N, L] int64, right-padded with 0
    fed: list[int]  # positions fed per row (len(prompt) + len(tokens) - 1)
    positions: torch.Tensor  # [N, T] the input position whose logits predict token j (0 past the end)
    targets: torch.Tensor  # [N, T] generated ids (0 past the end)
    mask: torch.Tensor  # [N, T] float: 1 on the tokens the model generated (0: padding, tool output)


def pack(trajectories: list[Trajectory]) -> Packed:
    seqs = [t.prompt + t.tokens for t in trajectories]
    N, L = len(seqs), max(len(s) - 1 for s in seqs)
    T = max(len(t.tokens) for t in trajectories)
    inputs = torch.zeros(N, L, dtype=torch.long)
    positions = torch.zeros(N, T, dtype=torch.long)
    targets = torch.zeros(N, T, dtype=torch.long)
    mask = torch.zeros(N, T)
    for b, (t, s) in enumerate(zip(trajectories, seqs, strict=True)):
        n = len(t.tokens)
        inputs[b, : len(s) - 1] = torch.tensor(s[:-1])
        positions[b, :n] = torch.arange(len(t.prompt) - 1, len(t.prompt) - 1 + n)
        targets[b, :n] = torch.tensor(t.tokens)
        mask[b, :n] = 1.0 - torch.tensor(t.env, dtype=torch.float) if t.env else 1.0
    return Packed(inputs, [len(s) - 1 for s in seqs], positions, targets, mask)


def token_logprobs(model: nn.Module, packed: Packed, temperature: float) -> torch.Tensor:
    """[N, T] log-prob of each generated token under the model (T > 0 as sampled); 0 past the end."""
    logits = model(packed.inputs)  # [N, L, V]
    V = logits.shape[-1]
    picked = logits.gather(1, packed.positions[..., None].expand(-1, -1, V)).float()  # [N, T, V]
    logp = torch.log_softmax(picked / temperature, dim=-1).gather(-1, packed.targets[..., None])[..., 0]
    return logp * packed.mask


def replay_indices(
    model: nn.Module, trajectories: list[Trajectory], packed: Packed
) -> dict[int, torch.Tensor]:
    """route_with's input: per MoE layer [N * L, k], each row's recorded experts, padding rows filled with
    the row's last recorded choice (padding never reaches a real token)."""
    layers = sorted(model.routers())
    N, L = packed.inputs.shape
    rows = []
    for t, fed in zip(trajectories, packed.fed, strict=True):
        if t.experts is None or t.experts.shape[0] != fed:
            raise ValueError(
                f"trajectory {t.group}/{t.sample}: recorded experts for "
                f"{None if t.experts is None else t.experts.shape[0]} positions, {fed} were fed"
            )
        rows.append(torch.cat([t.experts, t.experts[-1:].expand(L - fed, -1, -1)]))  # [L, n_moe, k]
    stacked = torch.stack(rows).flatten(0, 1)  # [N * L, n_moe, k]
    return {layer: stacked[:, j] for j, layer in enumerate(layers)}


def forward_logprobs(
    model: nn.Module,
    trajectories: list[Trajectory],
    temperature: float,
    replay: bool,
    packed: Packed | None = None,
) -> torch.Tensor:
    """token_logprobs, with the rollout's experts (`replay`, route_with) or the model's own routing."""
    packed = packed or pack(trajectories)
    if not replay:
        return token_logprobs(model, packed, temperature)
    with route_with(model, replay_indices(model, trajectories, packed)):
        return token_logprobs(model, packed, temperature)


@dataclass
class Consistency:
    logprob_diff_mean: float  # mean |trainer - engine| over generated tokens of the current version
    logprob_diff_max: float
    expert_flips: float  # share of fed positions where some MoE layer chose other experts (nan: none)
    trainer_logprobs: torch.Tensor  # [N, T] (own routing)


@torch.no_grad()
def check_consistency(
    model: nn.Module, trajectories: list[Trajectory], temperature: float, version: int
) -> Consistency:
    """Teacher-forced forward with the model's own routing, against what the engine reported: log-probs
    of the tokens the current `version` drew, and (where recorded) the experts at every fed position."""
    packed = pack(trajectories)
    with record_routing(model, scores=False, weights=False) as trace:
        logp = token_logprobs(model, packed, temperature)
    diffs = []
    for b, t in enumerate(trajectories):
        for j, (lp, v) in enumerate(zip(t.logprobs, t.versions, strict=True)):
            if v == version:
                diffs.append(abs(float(logp[b, j]) - lp))
    flips, counted = 0, 0
    layers = trace.layers
    if layers and all(t.experts is not None for t in trajectories):
        N, L = packed.inputs.shape
        own = torch.stack([trace.indices(layer).view(N, L, -1) for layer in layers], 2)  # [N, L, n_moe, k]
        for b, (t, fed) in enumerate(zip(trajectories, packed.fed, strict=True)):
            mine, theirs = own[b, :fed].sort(-1).values, t.experts.sort(-1).values  # [fed, n_moe, k]
            flips += int((mine != theirs).any(-1).any(-1).sum())
            counted += fed
    return Consistency(
        logprob_diff_mean=sum(diffs) / len(diffs) if diffs else float("nan"),
        logprob_diff_max=max(diffs) if diffs else float("nan"),
        expert_flips=flips / counted if counted else float("nan"),
        trainer_logprobs=logp,
    )
