"""The (latent) mixture of experts: router, routed experts (MXFP4-packed), latent projections, shared experts.

    s        = sigmoid(gate(x))                      fp32, [N, E]
    chosen   = top-k of s + e_score_correction_bias  (noaux_tc: the bias only steers the choice)
    p        = s[chosen] / sum(s[chosen]) * routed_scaling_factor     (renormalised only when k > 1)
    z        = routed_expert_down_proj(x)            the latent [N, L] (Kimi Linear: z = x)
    r        = routed_expert_up_proj(rms(sum_e p_e w2(act(w1 z, w3 z)), routed_expert_norm))
    out      = r + shared_experts(x)

Dispatch groups the (token, expert) pairs by expert: one matmul per active expert, on packed weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from k3.config import K3Config
from k3.model.activations import GatedActivation, gated_activation, native_activation, situ_parameters
from k3.model.mlp import MLP
from k3.model.norm import NATIVE_WEIGHT_DTYPES, Linear, RMSNorm, as_dtype, parameter
from k3.ops.decode.native import load_native as load_decode_native
from k3.ops.mxfp4 import MXFP4Linear, experts_one_token


class Routing(NamedTuple):
    """What a router decided for N tokens (fp32 but the ids)."""

    weights: torch.Tensor  # [N, k] mixing weights of the chosen experts
    indices: torch.Tensor  # [N, k] chosen expert ids
    scores: torch.Tensor  # [N, E] unbiased sigmoid scores


class Router(nn.Module):
    """Sigmoid router with biased top-k selection and unbiased, renormalised weights (fp32)."""

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        E = cfg.num_experts
        self.weight = nn.Parameter(torch.zeros(E, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        self.top_k, self.num_groups, self.topk_groups = (
            cfg.num_experts_per_token,
            cfg.num_expert_group,
            cfg.topk_group,
        )
        # the release renormalises only when top-k > 1 (one chosen weight stays its sigmoid score)
        self.renormalize = cfg.moe_renormalize and self.top_k > 1
        self.scaling = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> Routing:
        """x [N, hidden] -> the routing of its N tokens."""
        scores = self.scores(x)
        return self.routing(scores, self.choose(scores))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> the unbiased scores [N, E], fp32."""
        return torch.sigmoid(as_dtype(x, torch.float32) @ as_dtype(self.weight, torch.float32).t())

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [N, E] -> the top-k experts [N, k] of the biased scores (within the best groups)."""
        choice = scores + as_dtype(self.e_score_correction_bias, torch.float32)
        if self.num_groups > 1:  # keep the best `topk_group` groups, ranked by the sum of their top-2 scores
            N, E = choice.shape
            grouped = choice.view(N, self.num_groups, E // self.num_groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, groups]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(N, E)
        return choice.topk(self.top_k, dim=-1).indices

    def routing(self, scores: torch.Tensor, indices: torch.Tensor) -> Routing:
        """The mixing weights of the experts `indices` [N, k]: their unbiased scores, renormalised, scaled."""
        weights = scores.gather(1, indices)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(weights * self.scaling, indices, scores)


class RoutedExpert(nn.Module):
    """`w2(act(w1 z, w3 z))`; w1 = gate [m, L], w3 = up [m, L], w2 = down [L, m], MXFP4 or plain."""

    def __init__(self, latent: int, intermediate: int, act: GatedActivation, quantized: bool) -> None:
        super().__init__()
        if quantized:
            self.w1, self.w3 = MXFP4Linear(latent, intermediate), MXFP4Linear(latent, intermediate)
            self.w2 = MXFP4Linear(intermediate, latent)
        else:
            self.w1, self.w3 = Linear(latent, intermediate), Linear(latent, intermediate)
            self.w2 = Linear(intermediate, latent)
        self.act = act
        self.native_activation = False  # K3ForCausalLM.set_native_activations

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(z), self.w3(z), native=self.native_activation))

    def dequantize(self, dtype: torch.dtype) -> None:
        """Replace packed weights by plain trainable ones (their exact dequantized values)."""
        for name in ("w1", "w3", "w2"):
            packed = getattr(self, name)
            if isinstance(packed, MXFP4Linear):
                plain = Linear(packed.in_features, packed.out_features)
                plain.weight = nn.Parameter(packed.dequantized_weight(dtype))
                setattr(self, name, plain)


# A many-token dispatch runs in one native call (experts_over_rows: each expert's rows through the decode
# step's kernels, up to 8 rows of x per pass over its weights, the experts spread over the threads) while
# the busiest expert has at most NATIVE_DISPATCH_ROWS rows, or NATIVE_DISPATCH_ROWS_SMALL when an expert's
# three matrices take at most SMALL_EXPERT_BYTES (they then stay in a core's cache from pass to pass);
# above, one matmul per expert (MXFP4 weights decoded into tiles for the GEMM) is faster. Measured on an
# AVX2-only EPYC (docs/native-mxfp4.md, "Prefill experts in one call"): K3's experts level at 16 rows,
# 0.81x at 32; `mini`'s 1.5x at 46 rows and 0.95x at 77 (1 thread), 1.7x at 78 and 0.83x at 290 (2 threads).
NATIVE_DISPATCH_ROWS = 16
NATIVE_DISPATCH_ROWS_SMALL = 64
SMALL_EXPERT_BYTES = 256 * 1024


class ExpertWeights(NamedTuple):
    """The matrices of some experts as the native kernels take them: (w1, w3, w2) per expert, in order."""

    dense: list[torch.Tensor]  # fp32 or BF16 [out, in] each, or empty
    packed: list[torch.Tensor]  # MXFP4 [out, in/2] uint8 each, or empty
    scale: list[torch.Tensor]  # MXFP4 [out, in/32] uint8 each, or empty
    int8_x: bool  # MXFP4 with inputs rounded to int8 per block (their `int8_inputs`)


class ExpertMatrices(NamedTuple):
    """One RoutedExpert's (w1, w3, w2) as native_expert_weights gathers them."""

    dense: tuple[torch.Tensor, ...]  # fp32 or BF16, or empty
    packed: tuple[torch.Tensor, ...]  # MXFP4, or empty
    scale: tuple[torch.Tensor, ...]
    quantized: tuple[MXFP4Linear, ...]  # the MXFP4 matrices, whose `int8_inputs` each call reads


def expert_matrices(expert: nn.Module) -> ExpertMatrices | None:
    """An expert's matrices, read from the module dicts; None when the kernels do not take them (another
    kind of matrix, MXFP4 and plain mixed, a dtype they do not read)."""
    modules = expert.__dict__["_modules"]
    dense, packed, scale, quantized = [], [], [], []
    for name in ("w1", "w3", "w2"):
        matrix = modules.get(name)  # None: not an expert the kernels know (a RemoteExpert: another rank's)
        if isinstance(matrix, MXFP4Linear):
            packed.append(parameter(matrix, "weight_packed"))
            scale.append(parameter(matrix, "weight_scale"))
            quantized.append(matrix)
        elif isinstance(matrix, Linear) and matrix.weight.dtype in NATIVE_WEIGHT_DTYPES:
            dense.append(parameter(matrix, "weight"))
        else:
            return None
    if dense and packed:
        return None
    return ExpertMatrices(tuple(dense), tuple(packed), tuple(scale), tuple(quantized))


def native_expert_weights(
    experts: list[nn.Module], known: dict[nn.Module, ExpertMatrices | None] | None = None
) -> ExpertWeights | None:
    """The matrices (w1, w3, w2) of these RoutedExperts for the native kernels when all are MXFP4 (one
    `int8_inputs` mode) or all plain fp32 / BF16 Linears; None otherwise (mixed kinds or modes: each expert
    its own forward). `known`: each expert's `expert_matrices` from earlier calls, kept and added to (a
    decode step asks this for every MoE layer; k3.model.fused.DecodePlan keeps them between steps)."""
    dense: list[torch.Tensor] = []
    packed: list[torch.Tensor] = []
    scale: list[torch.Tensor] = []
    int8_modes = set()
    for expert in experts:
        if known is None:
            matrices = expert_matrices(expert)
        elif (matrices := known.get(expert)) is None and expert not in known:
            matrices = known[expert] = expert_matrices(expert)
        if matrices is None:
            return None
        dense += matrices.dense
        packed += matrices.packed
        scale += matrices.scale
        int8_modes.update(matrix.int8_inputs for matrix in matrices.quantized)
    if (dense and packed) or len(int8_modes) > 1:
        return None
    return ExpertWeights(dense, packed, scale, int8_modes == {True})


def busiest_expert(starts: list[int]) -> int:
    """The most pairs any expert has, from `pairs_by_expert`'s starts."""
    return max(b - a for a, b in zip(starts, starts[1:], strict=False))


def pairs_by_expert(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The N*k (token, expert) pairs of indices [N, k] (pair j = token j // k, expert indices.flat[j]) grouped
    by expert: their order [N*k] (stable: by token within an expert), and where each expert's pairs start
    (expert e's are order[starts[e] : starts[e + 1]])."""
    flat = indices.reshape(-1)
    order = flat.argsort(stable=True)
    starts = [0]
    for count in torch.bincount(flat, minlength=num_experts).tolist():
        starts.append(starts[-1] + count)
    return order, starts


class MoE(nn.Module):
    """Latent MoE (K3) or plain MoE (Kimi Linear, `routed_expert_hidden_size` unset)."""

    def __init__(self, cfg: K3Config, quantized_experts: bool | None = None) -> None:
        super().__init__()
        H, L, m = cfg.hidden_size, cfg.expert_input_size, cfg.moe_intermediate_size
        act = gated_activation(cfg)
        quantized = cfg.experts_mxfp4 if quantized_experts is None else quantized_experts
        self.gate = Router(cfg)
        self.latent = cfg.is_latent_moe  # experts run on a down-projected latent (K3)
        self.latent_norm = self.latent and cfg.latent_moe_use_norm  # ... normalised before the up-projection
        self.shared = cfg.num_shared_experts > 0  # shared experts beside the routed ones
        if self.latent:
            latent_linear = MXFP4Linear if "latent_projections" in cfg.packed_components else Linear
            self.routed_expert_down_proj = latent_linear(H, L)
            if self.latent_norm:
                self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps)
            self.routed_expert_up_proj = latent_linear(L, H)
        self.experts = nn.ModuleList(RoutedExpert(L, m, act, quantized) for _ in range(cfg.num_experts))
        if self.shared:
            packed = "shared_experts" in cfg.packed_components
            self.shared_experts = MLP(cfg, H, cfg.num_shared_experts * m, packed=packed)
        self.situ = situ_parameters(cfg)  # the activation's parameters for the native kernels
        # without gradients, a token's experts in one native call (dispatch_one), and many tokens' (few
        # rows an expert: experts_over_rows); False: one expert at a time
        self.fast_decode = True
        self.load_experts: Callable[[torch.Tensor], None] | None = None  # experts read on first use (URLs)

    def dispatch(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """sum_e p_e e(z) for every token: z [N, L], weights/indices [N, k] -> [N, L].

        The N*k (token, expert) pairs are sorted by expert so each active expert runs once on its rows
        (all of them in one native call where `experts_over_rows` can, else one matmul per expert); the
        results are put back in pair order and summed per token (no scatter-add: it is slow on CPU and
        not deterministic).
        """
        N, k = indices.shape
        native = self.fast_decode and not torch.is_grad_enabled()  # the native paths have no backward
        if N == 1 and native:
            return self.dispatch_one(z, weights[0], indices[0])
        order, starts = pairs_by_expert(indices, len(self.experts))
        busiest, sorted_out = busiest_expert(starts), None
        if native and busiest <= NATIVE_DISPATCH_ROWS_SMALL:  # else no gathered copy of every pair's row
            sorted_out = self.experts_over_rows(z[order // k], starts, busiest)  # rows [N*k, L], expert order
        if sorted_out is None:  # each expert's rows straight to their pairs' places: [N*k, L] in pair order
            pair_out = z.new_empty(N * k, z.shape[-1])
            for e in range(len(self.experts)):
                a, b = starts[e], starts[e + 1]
                if a < b:
                    rows = order[a:b]
                    pair_out.index_copy_(0, rows, as_dtype(self.experts[e](z[rows // k]), z.dtype))
        else:
            pair_out = torch.empty_like(sorted_out)
            pair_out[order] = sorted_out  # back to pair order [N*k, L]
        return torch.einsum("nkl,nk->nl", pair_out.view(N, k, -1), weights.to(z.dtype))

    def dispatch_one(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """`dispatch` for one token (a decode step): z [1, L], weights/indices [k] -> [1, L].

        No sort, count or scatter: the k chosen experts run in one native call (k3.ops.mxfp4.experts;
        MXFP4 or fp32 weights, else one torch op at a time), summed in the order of `indices`.
        """
        experts = [self.experts[e] for e in indices.tolist()]
        return experts_one_token(z, [(e.w1, e.w3, e.w2) for e in experts], weights, self.situ)

    def experts_over_rows(self, rows: torch.Tensor, starts: list[int], busiest: int) -> torch.Tensor | None:
        """Expert e's output for each of its rows `rows[starts[e] : starts[e + 1]]` (rows [R, L], experts in
        order), in one native call (k3.ops.decode's `experts_rows`, the experts spread over the threads; each
        row's value independent of the others). For fp32 rows on the CPU, MXFP4 experts (one int8 mode), and
        at most NATIVE_DISPATCH_ROWS(_SMALL) rows for the `busiest` expert of the whole batch (a
        rank of k3.dist passes the batch's, so that it decides as one process would); None otherwise."""
        if busiest > NATIVE_DISPATCH_ROWS_SMALL or rows.dtype != torch.float32 or not rows.is_cpu:
            return None
        uncapped_situ = self.situ is not None and self.situ[1] is None  # the kernels cap the up projection
        if uncapped_situ:
            return None
        native = load_decode_native()
        if native is None:
            return None
        active = [e for e in range(len(starts) - 1) if starts[e + 1] > starts[e]]
        if not active:
            return None
        experts = self.experts._modules  # {"0": RoutedExpert, ...}
        found = native_expert_weights([experts[str(e)] for e in active])  # type: ignore[misc]
        if found is None or not found.packed:
            # plain experts are a model in training (k3.rl and k3.distill dequantize them): its forward
            # without gradients keeps the differentiable one's values, so that a model scoring its own
            # samples sees the numbers it trains on (a self-teacher's KL gradient exactly 0)
            return None
        matrix_bytes = sum(t.nbytes for t in (*found.dense, *found.packed, *found.scale))
        expert_bytes = matrix_bytes // len(active)  # every expert of a layer has the same shapes
        if busiest > NATIVE_DISPATCH_ROWS and expert_bytes > SMALL_EXPERT_BYTES:
            return None
        return native.experts_rows(
            rows.contiguous(),
            [starts[e + 1] - starts[e] for e in active],
            found.dense,
            found.packed,
            found.scale,
            *native_activation(self.situ),
            int8_x=found.int8_x,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, hidden]
        weights, indices, _ = self.gate(flat)
        if self.load_experts is not None:  # k3.model.on_demand: read the chosen experts not read yet
            self.load_experts(indices)
        z = self.routed_expert_down_proj(flat) if self.latent else flat  # [N, L]
        return self.finish(flat, self.dispatch(z, weights, indices)).view(shape)

    def finish(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """The rest after the dispatch: x [N, hidden], the experts' mixture r [N, L] -> [N, hidden]
        (latent norm and up-projection, plus the shared experts)."""
        if self.latent:
            if self.latent_norm:
                r = self.routed_expert_norm(r)
            r = self.routed_expert_up_proj(r)
        if self.shared:
            r = r + self.shared_experts(x)
        return r
