"""One layer at a time, with the model's own modules: build on the meta device, fill with a stage's
tensors, run, empty again.

The arithmetic is `K3DecoderLayer.forward` and `MoE.forward` split where the schedule needs a break: the
mixer runs prompt by prompt (chunk by chunk through the layer's cache state), the FFN once over the tokens
of every prompt, and the routed experts one at a time as their weights arrive. `expert_dispatch` is
`MoE.dispatch` with the experts streamed in: the same sort by expert and per-expert matmuls on the same
rows, summed expert by expert into one [N, L] result (no [N * k, L] pair buffers: bounded by tokens x L).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from k3.config import K3Config, Mixer
from k3.model.attn_res import ResidualStream
from k3.model.cache import KDAState, MLAState
from k3.model.loading import assign_tensor
from k3.model.model import K3DecoderLayer, K3Model
from k3.model.moe import MoE, pairs_by_expert
from k3.model.norm import Linear, parameter
from k3.vision.projector import Projector
from k3.vision.tower import VisionTower

Tensors = dict[str, torch.Tensor]
LayerState = KDAState | MLAState


class Ends(nn.Module):
    """The parts outside the layers: embedding, output AttnRes read, final norm (lm_head: `head_block`)."""

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.model = K3Model(cfg, num_layers=0)


class Eyes(nn.Module):
    """The vision stage's modules under their published names (`vision_tower.…`, `mm_projector.…`), as
    K3ForConditionalGeneration holds them."""

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        assert cfg.vision_config is not None
        self.vision_tower = VisionTower(cfg.vision_config)
        self.mm_projector = Projector(cfg.vision_config, cfg.hidden_size)


def empty_eyes(cfg: K3Config) -> Eyes:
    with torch.device("meta"):
        return Eyes(cfg)


def head_block(weight: torch.Tensor) -> Linear:
    """lm_head over a block of its vocabulary rows, weight [rows, hidden] (the stage's tensor, in place)."""
    with torch.device("meta"):
        block = Linear(weight.shape[1], weight.shape[0])
    fill(block, {"weight": weight})
    return block


def empty_layer(cfg: K3Config, index: int) -> K3DecoderLayer:
    with torch.device("meta"):
        return K3DecoderLayer(cfg, index)


def empty_ends(cfg: K3Config) -> Ends:
    with torch.device("meta"):
        return Ends(cfg)


def fill(module: nn.Module, tensors: Tensors) -> None:
    for name, tensor in tensors.items():
        assign_tensor(module, name, tensor, requires_grad=False)


def release(module: nn.Module, names: Iterable[str]) -> None:
    """Put the tensors `names` back on the meta device: their memory goes with the last reference."""
    for name in names:
        path, _, attr = name.rpartition(".")
        meta = parameter(module.get_submodule(path), attr).to("meta")
        assign_tensor(module, name, meta, requires_grad=False)


def new_state(cfg: K3Config, index: int) -> LayerState:
    """The empty cache state of layer `index` for one sequence."""
    if cfg.layer_plan[index].mixer is Mixer.KDA:
        return KDAState()
    return MLAState(torch.zeros(1, dtype=torch.long))


def run_mixer(
    cfg: K3Config, layer: K3DecoderLayer, stream: ResidualStream, state: LayerState | None, chunk_tokens: int
) -> torch.Tensor:
    """Advance one prompt's stream [1, T, H] through the mixer; returns the FFN's input [1, T, H].

    Without a state and within one chunk this is exactly the first half of `K3DecoderLayer.forward`
    (`mixer_input`, `self_attn`, `ffn_input`);
    longer prompts go through KDA `chunk_tokens` at a time, carrying its state from chunk to chunk. MLA
    takes a long prompt in one causal pass (torch's fused kernel, memory linear in T, as the ordinary
    forward) and, when generating, then writes the prompt's latents into its empty cache: chunk by chunk
    every chunk would take a [chunk, S] mask and expand the keys and values of the whole context so far.
    """
    h = layer.mixer_input(stream)  # [1, T, H]
    T = h.shape[1]
    long = T > chunk_tokens
    if cfg.layer_plan[layer.index].mixer is Mixer.MLA and (state is None or (long and _empty(state))):
        mixed = layer.self_attn(h)  # [1, T, H]: one causal pass
        if state is not None:  # the cache a chunked pass would have written: every position's latents
            c, k_rope = layer.self_attn.latents(h)
            state.append(c, k_rope, torch.full((1,), T, dtype=torch.long))  # type: ignore[union-attr]
    elif state is None and not long:
        mixed = layer.self_attn(h)
    else:
        state = state if state is not None else new_state(cfg, layer.index)  # KDA: carried chunk to chunk
        mixed = torch.cat(
            [layer.self_attn(h[:, a : a + chunk_tokens], state) for a in range(0, T, chunk_tokens)], dim=1
        )  # type: ignore[arg-type]
    stream.add(mixed)
    return layer.ffn_input(stream)


def _empty(state: LayerState) -> bool:
    return isinstance(state, MLAState) and int(state.lengths.max()) == 0


def route(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] -> (mixing weights [N, k], chosen experts [N, k], expert input z [N, L]), as `MoE.forward`."""
    weights, indices, _ = moe.gate(x)
    z = moe.routed_expert_down_proj(x) if moe.latent else x
    return weights, indices, z


Experts = Callable[[list[int]], Iterable[tuple[int, Tensors]]]
EXPERT_ROWS = 4096  # tokens an expert runs on at once: bounds its hidden activations [rows, 2 x m]


def expert_dispatch(
    moe: MoE, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: Experts
) -> torch.Tensor:
    """sum_e p_e e(z) [N, L], as `MoE.dispatch(z, weights, indices)`, with `experts(chosen)` yielding
    (expert, its tensors) for every chosen expert (in any order: the reader's file order); each is filled,
    run on its tokens EXPERT_ROWS at a time, added into the result with its weights, and released.

    Unlike `MoE.dispatch` (which keeps every (token, expert) pair's output, [N * k, L] twice, and sums
    them per token in the order of the choices), the sum is accumulated expert by expert: memory per token
    is one [L] row, not 2k; the sums differ from the model's by rounding only (the order of the k terms).
    """
    N, k = indices.shape
    order, starts = pairs_by_expert(indices, len(moe.experts))
    tokens = order // k  # [N * k] the token of each pair, in expert order
    mix = weights.reshape(-1)[order].to(z.dtype)  # [N * k] its weight
    r = z.new_zeros(N, z.shape[-1])  # [N, L]
    chosen = [e for e in range(len(moe.experts)) if starts[e] < starts[e + 1]]
    for e, tensors in experts(chosen):
        expert = moe.experts[e]
        fill(expert, tensors)
        for a in range(starts[e], starts[e + 1], EXPERT_ROWS):
            b = min(a + EXPERT_ROWS, starts[e + 1])
            rows = tokens[a:b]  # distinct: a token chooses an expert once
            r.index_add_(0, rows, expert(z[rows]) * mix[a:b, None])
        release(expert, tensors)
    return r
