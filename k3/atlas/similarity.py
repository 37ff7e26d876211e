"""Cosine similarity between the experts of one MoE layer, on their flattened (dequantized) matrices.

The seed measured neighbours (expert e against e+1) and found 0.000-0.002. The atlas computes, per layer
and per matrix kind (w1, w2, w3), the cosine of:

* every neighbour pair (e, e+1);
* every pair within a subset of up to `SUBSET` experts spread evenly over the layer (the cosine matrix the
  page draws);
* `SAMPLED_PAIRS` further pairs drawn at random with a fixed seed.

Memory stays bounded whatever the expert size: the matrices are walked together in row chunks, each chunk
dequantized for every expert involved into one reused buffer, the dot products (float32 per chunk)
accumulated over chunks in float64.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

SUBSET = 16
SAMPLED_PAIRS = 64
MEMORY_BUDGET = 256 * 2**20  # bytes of dequantized rows held at once


def expert_pairs(
    num_experts: int, subset: int = SUBSET, sampled: int = SAMPLED_PAIRS, seed: int = 0
) -> tuple[list[tuple[int, int]], list[int]]:
    """(sorted pairs (a < b) to measure, the subset of experts whose full cosine matrix is measured)."""
    if num_experts < 2:
        return [], []
    k = min(subset, num_experts)
    chosen = sorted({round(i * (num_experts - 1) / (k - 1)) for i in range(k)})
    pairs = {(e, e + 1) for e in range(num_experts - 1)}
    pairs |= {(a, b) for i, a in enumerate(chosen) for b in chosen[i + 1 :]}
    rng = random.Random(seed)
    all_pairs = num_experts * (num_experts - 1) // 2
    target = min(all_pairs, len(pairs) + sampled)
    while len(pairs) < target:
        a, b = sorted(rng.sample(range(num_experts), 2))
        pairs.add((a, b))
    return sorted(pairs), chosen


def cosine_similarities(
    experts: list[int],
    rows: int,
    cols: int,
    load_rows: Callable[[int, int, int], torch.Tensor],
    pairs: list[tuple[int, int]],
    memory_budget: int = MEMORY_BUDGET,
) -> dict[tuple[int, int], float | None]:
    """Cosine of each pair of experts, whose matrices are [rows, cols].

    `load_rows(expert, start, stop)` returns float32 [stop-start, cols]. A pair involving an all-zero
    matrix has no cosine (None).
    """
    involved = sorted({e for p in pairs for e in p})
    if not involved:
        return {}
    missing = [e for e in involved if e not in experts]
    if missing:
        raise ValueError(f"pairs name experts that are not in this layer: {missing[:5]}")
    slot = {e: i for i, e in enumerate(involved)}
    step = max(1, min(rows, memory_budget // (4 * cols * len(involved))))
    dots = [0.0] * len(pairs)
    norms_sq = [0.0] * len(involved)
    x = torch.empty(len(involved), step * cols, dtype=torch.float32)  # the row chunk of every expert
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        n = (r1 - r0) * cols
        for i, e in enumerate(involved):
            x[i, :n] = load_rows(e, r0, r1).reshape(-1)
            norms_sq[i] += float(torch.dot(x[i, :n], x[i, :n]))
        for k, (a, b) in enumerate(pairs):
            dots[k] += float(torch.dot(x[slot[a], :n], x[slot[b], :n]))
    out: dict[tuple[int, int], float | None] = {}
    for k, (a, b) in enumerate(pairs):
        denom = math.sqrt(norms_sq[slot[a]] * norms_sq[slot[b]])
        out[(a, b)] = dots[k] / denom if denom > 0 else None
    return out
