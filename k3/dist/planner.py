"""Which rank computes which (token, expert) pairs: `plan(counts, slots_per_rank, policy)`.

Experts are sharded by id: expert e lives on rank `e // (E / R)` (its home). Every rank routes its own
tokens, the [R, E] pair counts are gathered, and every rank derives the same plan from them:

* `none`: every pair goes to its expert's home.
* `eplb` (DeepSeek's EPLB, from a load history [E]): the budget of R * slots_per_rank replicas goes, one
  at a time, to the expert with the largest load per copy; replicas are then packed heaviest first onto the
  least loaded rank that has a free slot and does not host the expert yet. An expert's pairs of the current
  batch are split into equal shares over its copies.
* `moonep` (from the current counts): every rank r should receive exactly its quota of the P pairs,
  `P // R` (+1 for the first `P % R` ranks). While a rank holds more than its quota, pairs of its experts
  move to replicas on ranks below quota. Each move takes the donor with the largest excess, the receiver
  with the largest deficit, and the donor's expert with the most pairs still at home (ties: lowest rank,
  lowest id), and moves min(excess, deficit, pairs at home) pairs. A new replica needs a free slot on the
  receiver and at least `min_pairs` pairs, else the next candidate is tried. With enough slots and
  `min_pairs` = 0 every rank ends exactly at its quota.

`min_pairs` is the threshold: a replica must carry at least that many pairs, so that the token traffic it
takes over outweighs the expert weights it costs (see `worthwhile_pairs`).

A plan is `route[s, e, h]`: how many of source rank s's pairs for expert e go to host h. Each host first
takes its share of an expert from its own pairs (no traffic); the rest of the expert's pairs, ordered
source by source, are cut into consecutive shares, hosts in ascending order. A source sends its e-pairs
to hosts in ascending order (k3.dist.moe), and without replicas each expert sees its pairs in exactly the
order one process would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from k3.errors import K3Error

POLICIES = ("none", "eplb", "moonep")


class PlanError(K3Error):
    """Counts or settings a plan cannot be made from."""


@dataclass
class Plan:
    route: np.ndarray  # [R, E, R] int64: pairs of (source, expert) sent to each host
    replicas: list[tuple[int, int]] = field(default_factory=list)  # (expert, host), sorted by (host, expert)

    @property
    def ranks(self) -> int:
        return self.route.shape[0]

    def received(self) -> np.ndarray:
        """[R] pairs each host computes."""
        return self.route.sum(axis=(0, 1))

    def remote_pairs(self) -> int:
        """Pairs that leave their source rank."""
        R = self.ranks
        return int(self.route.sum() - sum(self.route[r, :, r].sum() for r in range(R)))

    def rehomed_pairs(self, experts_per_rank: int) -> int:
        """Pairs computed by a replica instead of their expert's home."""
        homes = np.arange(self.route.shape[1]) // experts_per_rank
        at_home = self.route[:, np.arange(self.route.shape[1]), homes].sum()
        return int(self.route.sum() - at_home)


def home_of(num_experts: int, ranks: int) -> np.ndarray:
    """[E] the home rank of every expert."""
    if ranks < 1 or num_experts % ranks:
        raise PlanError(
            f"expert parallelism needs the experts ({num_experts}) to divide evenly over the ranks ({ranks})"
        )
    return np.arange(num_experts) // (num_experts // ranks)


def worthwhile_pairs(weight_bytes: int, pair_bytes: int) -> int:
    """The least pairs a replica must carry for their traffic (bytes per pair, there and back) to be at
    least the expert weights (and their gradients) it ships."""
    return math.ceil(weight_bytes / pair_bytes) if pair_bytes > 0 else 0


def _route(counts: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """counts [R, E] per source, shares [E, R] per host (same totals per expert) -> route [R, E, R].

    Local first: a host takes its share from its own pairs of the expert as far as they go. What is left
    is the overlap of source s's interval and host h's interval on each expert's line of remaining pairs.
    """
    R = counts.shape[0]
    local = np.minimum(shares, counts.T)  # [E, R] pairs a host computes of its own
    counts, shares = counts - local.T, shares - local
    src_hi = np.cumsum(counts, axis=0)  # [R, E]
    src_lo = src_hi - counts
    host_hi = np.cumsum(shares, axis=1)  # [E, R]
    host_lo = host_hi - shares
    hi = np.minimum(src_hi[:, :, None], host_hi[None])
    lo = np.maximum(src_lo[:, :, None], host_lo[None])
    route = np.clip(hi - lo, 0, None).astype(np.int64)
    route[np.arange(R), :, np.arange(R)] += local.T
    return route


def _replicas(shares: np.ndarray, homes: np.ndarray) -> list[tuple[int, int]]:
    """(expert, host) of every copy but the home that computes pairs, sorted by (host, expert)."""
    experts, hosts = np.nonzero(shares)
    found = [(int(e), int(h)) for e, h in zip(experts, hosts, strict=True) if h != homes[e]]
    return sorted(found, key=lambda p: (p[1], p[0]))


def eplb_placement(
    load: np.ndarray, ranks: int, slots_per_rank: int, min_pairs: int = 0
) -> list[tuple[int, int]]:
    """Replicas (expert, host) for the load history `load` [E] (pairs per expert and micro-batch, e.g. the
    mean over the last steps), by DeepSeek's EPLB: greedy replication, then heaviest-first packing."""
    load = np.asarray(load, dtype=np.float64)
    homes = home_of(len(load), ranks)
    copies = np.ones(len(load), dtype=np.int64)
    for _ in range(ranks * slots_per_rank):  # replication: the largest load per copy gets one more
        per_copy = np.where(copies < ranks, load / copies, -1.0)
        e = int(np.argmax(per_copy))
        if per_copy[e] <= 0 or load[e] / (copies[e] + 1) < min_pairs:
            break
        copies[e] += 1
    per_copy = load / copies
    rank_load = np.bincount(homes, weights=per_copy, minlength=ranks)
    free = np.full(ranks, slots_per_rank)
    hosted = {(int(e), int(homes[e])) for e in range(len(load))}
    items = sorted((-per_copy[e], e) for e in range(len(load)) for _ in range(copies[e] - 1))
    placed = []
    for _, e in items:  # packing: heaviest replica first, onto the least loaded rank that can take it
        options = [r for r in range(ranks) if free[r] > 0 and (e, r) not in hosted]
        if not options:
            continue
        r = min(options, key=lambda r: (rank_load[r], r))
        hosted.add((e, r))
        free[r] -= 1
        rank_load[r] += per_copy[e]
        placed.append((e, r))
    return sorted(placed, key=lambda p: (p[1], p[0]))


def _equal_shares(total: np.ndarray, hosts: list[list[int]], ranks: int) -> np.ndarray:
    shares = np.zeros((len(total), ranks), dtype=np.int64)
    for e, where in enumerate(hosts):
        n = len(where)
        for j, h in enumerate(sorted(where)):
            shares[e, h] = total[e] // n + (1 if j < total[e] % n else 0)
    return shares


def _moonep_shares(
    total: np.ndarray, homes: np.ndarray, ranks: int, slots_per_rank: int, min_pairs: int
) -> np.ndarray:
    E = len(total)
    shares = np.zeros((E, ranks), dtype=np.int64)
    shares[np.arange(E), homes] = total
    P = int(total.sum())
    quota = np.array([P // ranks + (1 if r < P % ranks else 0) for r in range(ranks)])
    load = shares.sum(axis=0)
    free = np.full(ranks, slots_per_rank)
    own = [np.nonzero(homes == r)[0] for r in range(ranks)]
    while True:
        excess = load - quota
        donors = sorted((int(-excess[r]), r) for r in range(ranks) if excess[r] > 0)
        receivers = sorted((int(excess[r]), r) for r in range(ranks) if excess[r] < 0)
        move = None
        for _, d in donors:
            at_home = shares[own[d], d]
            experts = [int(own[d][i]) for i in np.lexsort((own[d], -at_home)) if at_home[i] > 0]
            for _, r in receivers:
                for e in experts:
                    n = int(min(excess[d], -excess[r], shares[e, d]))
                    if shares[e, r] > 0 or (free[r] > 0 and n >= min_pairs):
                        move = d, r, e, n
                        break
                if move:
                    break
            if move:
                break
        if move is None:
            return shares
        d, r, e, n = move
        if shares[e, r] == 0:
            free[r] -= 1
        shares[e, d] -= n
        shares[e, r] += n
        load[d] -= n
        load[r] += n


def plan(
    counts: np.ndarray,
    slots_per_rank: int,
    policy: str,
    *,
    history: np.ndarray | None = None,
    min_pairs: int = 0,
) -> Plan:
    """The plan for the gathered pair counts `counts` [R, E] (source rank, expert).

    `slots_per_rank`: most replicas a rank may host. `history` [E]: the load EPLB plans from, in pairs per
    micro-batch (e.g. the mean over the last steps; the threshold compares it with `min_pairs`; None: no
    replicas yet). `min_pairs`: the replica threshold (see the module docstring)."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 2:
        raise PlanError(f"counts must be [ranks, experts], got shape {counts.shape}")
    if (counts < 0).any():
        raise PlanError("counts must not be negative")
    if slots_per_rank < 0:
        raise PlanError(f"slots per rank must be at least 0, got {slots_per_rank}")
    if policy not in POLICIES:
        raise PlanError(f"unknown expert-parallel policy {policy!r} (known: {', '.join(POLICIES)})")
    R, E = counts.shape
    homes = home_of(E, R)
    total = counts.sum(axis=0)
    if policy == "moonep":
        shares = _moonep_shares(total, homes, R, slots_per_rank, min_pairs)
    else:
        hosts = [[int(homes[e])] for e in range(E)]
        if policy == "eplb" and history is not None:
            if len(history) != E:
                raise PlanError(f"the load history has {len(history)} experts, the counts {E}")
            for e, h in eplb_placement(history, R, slots_per_rank, min_pairs):
                hosts[e].append(h)
        shares = _equal_shares(total, hosts, R)
    return Plan(_route(counts, shares), _replicas(shares, homes))
