"""Routing balance for training: quantile balancing (QB), the DeepSeek-V3 sign update, and an exact solver.

Routing one batch is a balanced assignment (spec section 6): with router scores `s` [T, E], choose
`x_te` in {0, 1} to maximise `sum x_te s_te` such that every token takes k experts and every expert takes
`q = T k / E` tokens. The LP relaxation is integral (a transportation problem), and its dual

    D(alpha, beta) = k sum_t alpha_t + q sum_e beta_e + sum_te max(0, s_te - alpha_t - beta_e)

has one price `beta_e` per expert. At the optimum the assignment is exactly `top-k(s - beta)` per token,
so `-beta` is a routing bias: mean-centred and averaged over batches it is what K3 stores as
`e_score_correction_bias`, and deployment routes with an ordinary biased top-k and no solver.

Quantile balancing minimises D by exact block coordinate descent: given beta, every `alpha_t` minimising D
lies between the k-th and (k+1)-th largest of `s_t - beta` (the token's cutoff); given alpha, every `beta_e`
minimising D lies between the q-th and (q+1)-th largest over tokens of `s_te - alpha_t` (the expert's
quantile). We take the midpoint of each interval. Taking an end point instead (the (k+1)-th / (q+1)-th
value itself) stalls on small batches at non-optimal points whose duality gap stays around 0.05-0.2 on
random sigmoid scores, with expert loads off by up to 50 %; the midpoint rule reached the LP optimum to
rounding error on every batch we tried (see tests/train/test_routing.py).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from k3.train.config import Balance

BALANCE_METHODS = tuple(Balance)


def _check_scores(scores: torch.Tensor, k: int) -> tuple[int, int]:
    if scores.dim() != 2:
        raise ValueError(f"scores must be [T, E], got shape {tuple(scores.shape)}")
    tokens, experts = scores.shape
    if not 0 < k <= experts:
        raise ValueError(f"k = {k} experts per token is outside 1..{experts} (the number of experts)")
    if tokens == 0:
        raise ValueError("scores hold no tokens")
    if not torch.isfinite(scores).all():
        raise ValueError("scores hold NaN or infinite values")
    return tokens, experts


def expert_capacity(tokens: int, experts: int, k: int) -> int:
    """q = T k / E tokens per expert, rounded down when E does not divide T k (then some experts take one
    more token than q in a balanced assignment)."""
    return tokens * k // experts


def quantile_balance_bias(
    scores: torch.Tensor, k: int, iters: int = 1, init_bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-expert routing biases [E] that balance the batch `scores` [T, E] for top-k routing.

    Runs `iters` rounds of quantile balancing (token cutoffs, then expert quantiles; see the module
    docstring), starting from `init_bias` (zero by default; pass the current bias to warm-start, which is
    what training does with one round per batch). Stops early at a fixed point. Returns `-beta`
    mean-centred, so routing is `top-k(scores + bias)`. Iterated to its fixed point this solves the
    balanced assignment exactly: the resulting top-k gives every expert exactly T k / E tokens (when E
    divides T k and scores are free of ties) and the objective of `balanced_assignment`.
    """
    tokens, experts = _check_scores(scores, k)
    if iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    q = expert_capacity(tokens, experts, k)
    if q == 0:
        raise ValueError(f"{tokens} tokens x top-{k} is fewer than one token per expert ({experts} experts)")
    if k == experts or q >= tokens:  # every token takes every expert: nothing to balance
        return torch.zeros(experts, dtype=scores.dtype, device=scores.device)
    if init_bias is not None and init_bias.shape != (experts,):
        raise ValueError(f"init_bias must have shape ({experts},), got {tuple(init_bias.shape)}")
    beta = torch.zeros(experts, dtype=scores.dtype) if init_bias is None else -init_bias.to(scores.dtype)
    for _ in range(iters):
        # token cutoffs: midpoint of the k-th and (k+1)-th largest of s_t - beta          # [T]
        top = torch.topk(scores - beta, k + 1, dim=1).values
        alpha = 0.5 * (top[:, k - 1] + top[:, k])
        # expert prices: midpoint of the q-th and (q+1)-th largest over tokens of s_e - alpha  # [E]
        top = torch.topk(scores - alpha[:, None], q + 1, dim=0).values
        new_beta = 0.5 * (top[q - 1] + top[q])
        converged = torch.equal(new_beta, beta)
        beta = new_beta
        if converged:
            break
    bias = -beta
    return bias - bias.mean()


def topk_assignment(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """0/1 assignment [T, E] of biased top-k routing: token t takes the k largest of `scores_t + bias`."""
    _check_scores(scores, k)
    biased = scores if bias is None else scores + bias
    chosen = torch.topk(biased, k, dim=1).indices  # [T, k]
    return torch.zeros_like(scores).scatter_(1, chosen, 1.0)


def expert_loads(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens per expert [E] under biased top-k routing."""
    return topk_assignment(scores, k, bias).sum(0)


def chosen_loads(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert [E] (float) from the experts each token was routed to, `chosen` [T, k]."""
    return torch.bincount(chosen.reshape(-1), minlength=num_experts).float()


def max_over_mean(loads: torch.Tensor) -> float:
    """The imbalance measure: the busiest expert's load over the mean load (1.0 = perfectly balanced)."""
    mean = loads.float().mean()
    if mean <= 0:
        raise ValueError("loads are all zero")
    return float(loads.float().max() / mean)


def balanced_assignment(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, float]:
    """The optimal balanced assignment of a batch, solved exactly: (x [T, E] of 0/1, objective sum x s).

    Every token takes exactly k experts; every expert takes at most ceil(T k / E) tokens, which is exactly
    T k / E each when E divides T k. Solved as the LP relaxation with HiGHS (scipy); the constraint matrix
    is that of a bipartite transportation problem, hence totally unimodular, so the LP optimum at a
    vertex is integral (checked). Meant for small batches (tests, benchmarks): the LP has T E variables.
    """
    import scipy.optimize
    import scipy.sparse

    tokens, experts = _check_scores(scores, k)
    capacity = math.ceil(tokens * k / experts)
    s = scores.detach().double().cpu().numpy()
    # variable x_te sits at column t * E + e
    per_token = scipy.sparse.kron(scipy.sparse.eye(tokens), np.ones((1, experts)))  # [T, T E]
    per_expert = scipy.sparse.kron(np.ones((1, tokens)), scipy.sparse.eye(experts))  # [E, T E]
    divisible = tokens * k % experts == 0
    result = scipy.optimize.linprog(
        -s.ravel(),
        A_eq=scipy.sparse.vstack([per_token, per_expert]).tocsr() if divisible else per_token.tocsr(),
        b_eq=np.concatenate([np.full(tokens, k), np.full(experts, capacity)])
        if divisible
        else np.full(tokens, k),
        A_ub=None if divisible else per_expert.tocsr(),
        b_ub=None if divisible else np.full(experts, capacity),
        bounds=(0.0, 1.0),
        method="highs",
    )
    if result.status != 0:
        raise RuntimeError(f"balanced assignment LP failed: {result.message}")
    x = result.x.reshape(tokens, experts)
    rounded = np.rint(x)
    if np.abs(x - rounded).max() > 1e-6:
        raise RuntimeError("balanced assignment LP returned a fractional vertex (should not happen)")
    return torch.from_numpy(rounded).to(scores.dtype), float((rounded * s).sum())


def deepseek_bias_update(bias: torch.Tensor, loads: torch.Tensor, gamma: float = 1e-3) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free update: `b_e += gamma * sign(mean_load - load_e)`."""
    if bias.shape != loads.shape:
        raise ValueError(f"bias {tuple(bias.shape)} and loads {tuple(loads.shape)} differ in shape")
    loads = loads.to(bias.dtype)
    return bias + gamma * torch.sign(loads.mean() - loads)


class RoutingBalancer:
    """Per-layer routing biases, updated after each batch from that batch's router scores.

    The bias a batch is routed with always comes from earlier batches (routing must not depend on the
    batch's own future tokens). Methods: `qb` (quantile balancing, warm-started from the current bias,
    `qb_iters` rounds per batch, mean-centred; optional EMA `b <- ema b + (1 - ema) b_batch`), `deepseek`
    (sign update with step `gamma`) and `none` (bias stays zero).
    """

    def __init__(
        self,
        layers: list[int],
        num_experts: int,
        k: int,
        method: str = "qb",
        gamma: float = 1e-3,
        ema: float = 0.0,
        qb_iters: int = 1,
    ) -> None:
        if method not in BALANCE_METHODS:
            raise ValueError(f"unknown balance method {method!r} (known: {', '.join(BALANCE_METHODS)})")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        self.method, self.k, self.gamma, self.ema, self.qb_iters = method, k, gamma, ema, qb_iters
        self.biases = {layer: torch.zeros(num_experts, dtype=torch.float32) for layer in layers}

    def update(self, layer: int, scores: torch.Tensor) -> torch.Tensor:
        """Fold one batch's router scores [T, E] (unbiased, after the sigmoid) into the layer's bias.

        Returns the expert loads [E] this batch had under the bias it was routed with, re-derived from the
        scores (the trainer, which has the router's own choices, counts them with `chosen_loads` and calls
        `fit`)."""
        scores = scores.detach().float()
        loads = expert_loads(scores, self.k, self.biases[layer])
        self.fit(layer, scores, loads)
        return loads

    def fit(self, layer: int, scores: torch.Tensor, loads: torch.Tensor | None = None) -> None:
        """Set the layer's bias from a batch's scores [T, E] (QB) or its loads [E] (DeepSeek)."""
        bias = self.biases[layer]
        if self.method == "qb":
            fresh = quantile_balance_bias(
                scores.detach().float(), self.k, iters=self.qb_iters, init_bias=bias
            )
            self.biases[layer] = self.ema * bias + (1.0 - self.ema) * fresh
        elif self.method == "deepseek":
            if loads is None:
                raise ValueError("the DeepSeek update needs the batch's expert loads")
            self.biases[layer] = deepseek_bias_update(bias, loads, self.gamma)
