"""The planner against a slow reference written here (pair by pair), its invariants and edge cases."""

from __future__ import annotations

import numpy as np
import pytest

from k3.dist.planner import PlanError, eplb_placement, plan, worthwhile_pairs


# ---- the slow reference -----------------------------------------------------------------------------
def reference_route(counts, hosts_shares):
    """Walk every pair: a host first takes its own pairs of expert e, one by one, until its share is full;
    the rest, source by source, go to the hosts in ascending order, each host taking the pairs its share
    still lacks. hosts_shares[e] = {host: pairs}."""
    R, E = counts.shape
    route = np.zeros((R, E, R), dtype=np.int64)
    for e in range(E):
        left = dict(hosts_shares[e])
        line = []  # the sources of the pairs no host took locally, in order
        for s in range(R):
            for _ in range(counts[s, e]):
                if left.get(s, 0) > 0:
                    route[s, e, s] += 1
                    left[s] -= 1
                else:
                    line.append(s)
        cuts = [h for h in sorted(left) for _ in range(left[h])]
        assert len(line) == len(cuts)
        for s, h in zip(line, cuts, strict=True):
            route[s, e, h] += 1
    return route


def reference_moonep(counts, slots, min_pairs):
    R, E = counts.shape
    per = E // R
    home = [e // per for e in range(E)]
    total = [int(counts[:, e].sum()) for e in range(E)]
    shares = [{home[e]: total[e]} for e in range(E)]
    P = sum(total)
    quota = [P // R + (1 if r < P % R else 0) for r in range(R)]
    free = [slots] * R
    while True:
        load = [sum(shares[e].get(r, 0) for e in range(E)) for r in range(R)]
        candidates = []
        for d in range(R):
            for r in range(R):
                for e in range(E):
                    if home[e] != d or load[d] <= quota[d] or load[r] >= quota[r]:
                        continue
                    left = shares[e].get(d, 0)
                    if left == 0:
                        continue
                    n = min(load[d] - quota[d], quota[r] - load[r], left)
                    if r not in shares[e] and (free[r] == 0 or n < min_pairs):
                        continue
                    key = (-(load[d] - quota[d]), d, -(quota[r] - load[r]), r, -left, e)
                    candidates.append((key, d, r, e, n))
        if not candidates:
            break
        _, d, r, e, n = min(candidates)
        if r not in shares[e]:
            free[r] -= 1
            shares[e][r] = 0
        shares[e][d] -= n
        shares[e][r] += n
    shares = [{h: n for h, n in s.items() if n > 0 or h == home[e]} for e, s in enumerate(shares)]
    return reference_route(counts, shares), sorted(
        ((e, h) for e in range(E) for h, n in shares[e].items() if h != home[e] and n > 0),
        key=lambda p: (p[1], p[0]),
    )


def reference_eplb(load, R, slots, counts):
    E = len(load)
    per = E // R
    copies = [1] * E
    for _ in range(R * slots):
        best = max((load[e] / copies[e], -e) for e in range(E) if copies[e] < R)
        if best[0] <= 0:
            break
        copies[-best[1]] += 1
    share = [load[e] / copies[e] for e in range(E)]
    rank_load = [sum(share[e] for e in range(E) if e // per == r) for r in range(R)]
    hosts = [{e // per} for e in range(E)]
    free = [slots] * R
    items = sorted((-share[e], e) for e in range(E) for _ in range(copies[e] - 1))
    for _, e in items:
        options = [(rank_load[r], r) for r in range(R) if free[r] and r not in hosts[e]]
        if options:
            _, r = min(options)
            hosts[e].add(r)
            free[r] -= 1
            rank_load[r] += share[e]
    shares = []
    for e in range(E):
        t, hs = int(counts[:, e].sum()), sorted(hosts[e])
        shares.append({h: t // len(hs) + (1 if j < t % len(hs) else 0) for j, h in enumerate(hs)})
    return reference_route(counts, shares)


# ---- cases ------------------------------------------------------------------------------------------
def _random_counts(seed, R, E, skew):
    rng = np.random.default_rng(seed)
    popularity = rng.dirichlet(np.full(E, skew))
    return np.stack([rng.multinomial(rng.integers(0, 60), popularity) for _ in range(R)])


CASES = [(seed, R, E, skew) for seed in range(6) for R, E, skew in ((2, 8, 0.3), (4, 8, 1.0), (4, 16, 0.2))]


def check_invariants(p, counts, slots):
    R, E = counts.shape
    per = E // R
    assert (p.route >= 0).all()
    assert np.array_equal(p.route.sum(axis=2), counts), "a (source, expert) lost or gained pairs"
    hosting = p.route.sum(axis=0) > 0  # [E, R]
    for e, h in zip(*np.nonzero(hosting), strict=True):
        assert h == e // per or (int(e), int(h)) in p.replicas, "pairs sent to a rank that does not host"
    per_rank = np.bincount([h for _, h in p.replicas], minlength=R)
    assert (per_rank <= slots).all(), f"more replicas than slots: {per_rank}"


@pytest.mark.parametrize("seed, R, E, skew", CASES)
def test_moonep_matches_the_reference_and_meets_every_quota(seed, R, E, skew):
    counts = _random_counts(seed, R, E, skew)
    for slots, min_pairs in ((E, 0), (1, 0), (2, 3)):
        p = plan(counts, slots, "moonep", min_pairs=min_pairs)
        route, replicas = reference_moonep(counts, slots, min_pairs)
        assert np.array_equal(p.route, route) and p.replicas == replicas, (slots, min_pairs)
        check_invariants(p, counts, slots)
        if slots == E and min_pairs == 0:
            P = counts.sum()
            quota = [P // R + (1 if r < P % R else 0) for r in range(R)]
            assert p.received().tolist() == quota


@pytest.mark.parametrize("seed, R, E, skew", CASES)
def test_eplb_matches_the_reference(seed, R, E, skew):
    counts = _random_counts(seed, R, E, skew)
    history = _random_counts(seed + 100, R, E, skew).sum(0).astype(float)
    for slots in (1, 2):
        p = plan(counts, slots, "eplb", history=history)
        assert np.array_equal(p.route, reference_eplb(history, R, slots, counts))
        check_invariants(p, counts, slots)


@pytest.mark.parametrize("seed, R, E, skew", CASES[:6])
def test_none_sends_every_pair_home(seed, R, E, skew):
    counts = _random_counts(seed, R, E, skew)
    p = plan(counts, 3, "none")
    shares = [{e // (E // R): int(counts[:, e].sum())} for e in range(E)]
    assert np.array_equal(p.route, reference_route(counts, shares)) and p.replicas == []


# ---- MoonEP's edge cases ------------------------------------------------------------------------------
def test_one_token_top1_on_a_remote_expert():
    counts = np.zeros((2, 4), dtype=np.int64)
    counts[0, 3] = 1  # rank 0's only pair is for expert 3, homed on rank 1; rank 0's quota is that pair
    p = plan(counts, 1, "moonep")
    assert p.replicas == [(3, 0)] and p.route[0, 3, 0] == 1 and p.received().tolist() == [1, 0]
    p = plan(counts, 1, "moonep", min_pairs=2)  # not worth a replica: it goes home
    assert p.replicas == [] and p.route[0, 3, 1] == 1


def test_all_local_balanced_moves_nothing():
    counts = np.array([[5, 3, 0, 0], [0, 0, 4, 4]])
    p = plan(counts, 2, "moonep")
    assert p.replicas == [] and p.remote_pairs() == 0 and p.received().tolist() == [8, 8]


def test_all_remote():
    counts = np.array([[0, 0, 4, 4], [5, 3, 0, 0]])
    for policy in ("none", "moonep"):
        p = plan(counts, 2, policy)
        assert p.replicas == [] and p.remote_pairs() == 16


def test_a_single_hot_expert_is_spread_over_every_rank():
    counts = np.zeros((4, 8), dtype=np.int64)
    counts[:, 0] = [7, 5, 6, 2]  # every pair to expert 0 (home: rank 0)
    p = plan(counts, 1, "moonep")
    assert sorted(p.replicas) == [(0, 1), (0, 2), (0, 3)]
    assert p.received().tolist() == [5, 5, 5, 5]
    assert p.rehomed_pairs(2) == 15


def test_no_slots_means_no_replicas():
    counts = np.zeros((2, 4), dtype=np.int64)
    counts[:, 0] = 10
    assert plan(counts, 0, "moonep").replicas == []


def test_bad_input_is_refused_clearly():
    with pytest.raises(PlanError, match="divide evenly"):
        plan(np.ones((3, 8), dtype=np.int64), 1, "none")
    with pytest.raises(PlanError, match="unknown expert-parallel policy"):
        plan(np.ones((2, 8), dtype=np.int64), 1, "round-robin")
    with pytest.raises(PlanError, match="negative"):
        plan(-np.ones((2, 8), dtype=np.int64), 1, "none")


def test_threshold_pairs():
    # an expert of 3 x 32 x 64 fp32 weights against a latent of 32 fp32 there and back: 96 pairs
    assert worthwhile_pairs(3 * 32 * 64 * 4, 2 * 32 * 4) == 96
    assert worthwhile_pairs(100, 0) == 0


def test_eplb_placement_replicates_the_heaviest_first():
    load = np.array([100.0, 1, 1, 1, 50, 1, 1, 1])
    assert eplb_placement(load, 2, 1) == [(4, 0), (0, 1)]
