"""The differentiable all-to-all and the expert-parallel dispatch, on 2 and 4 gloo ranks."""

from __future__ import annotations

import time

import pytest
from dist_ranks import Ranks, assert_ok
from dist_workers import (
    dispatch_matches_one_process,
    exchange_is_a_permutation,
    raises_inside_moe,
    silent_rank,
)


def test_exchange_moves_tagged_rows_and_their_gradients_2_ranks(ranks2):
    assert_ok(ranks2.run(exchange_is_a_permutation, [[2, 3], [0, 1]]))


def test_exchange_with_an_empty_rank_4_ranks(ranks4):
    # rank 2 sends nothing and receives nothing; rank 0 sends everything to rank 3
    splits = [[1, 0, 0, 4], [2, 1, 0, 3], [0, 0, 0, 0], [1, 1, 0, 2]]
    assert_ok(ranks4.run(exchange_is_a_permutation, splits))


@pytest.mark.parametrize(
    "sizes, scenario",
    [([7, 5], "random"), ([0, 9], "random"), ([6, 6], "one_expert")],
    ids=["random", "empty-rank", "all-to-one-expert"],
)
def test_dispatch_without_replicas_is_bitwise_one_process_2_ranks(ranks2, sizes, scenario):
    assert_ok(ranks2.run(dispatch_matches_one_process, sizes, scenario, "none", 0, False, True))


@pytest.mark.parametrize(
    "policy, slots, history, scenario",
    [("moonep", 4, False, "hot"), ("moonep", 4, False, "one_expert"), ("eplb", 4, True, "random")],
    ids=["moonep-hot", "moonep-one-expert", "eplb-every-expert-duplicated"],
)
def test_dispatch_with_replicas_equals_one_process_2_ranks(ranks2, policy, slots, history, scenario):
    assert_ok(ranks2.run(dispatch_matches_one_process, [10, 6], scenario, policy, slots, history, False))


def test_dispatch_4_ranks_each_policy_with_an_empty_rank(ranks4):
    for policy, slots, history in (("none", 0, False), ("moonep", 2, False), ("eplb", 2, True)):
        bitwise = policy == "none"
        assert_ok(
            ranks4.run(dispatch_matches_one_process, [5, 0, 8, 3], "hot", policy, slots, history, bitwise)
        )


def test_a_rank_that_raises_inside_the_moe_stops_every_rank_with_its_error():
    began = time.monotonic()
    results = Ranks(2, collective_timeout=10.0).run(raises_inside_moe, 1, timeout=60.0)
    assert time.monotonic() - began < 50
    for rank in (0, 1):
        assert results[rank] is not None and "exploded on purpose" in results[rank], results
    assert "rank 1: RuntimeError" in results[0].splitlines()[0]


def test_a_rank_that_never_arrives_is_named_after_the_timeout():
    results = Ranks(2, collective_timeout=3.0).run(silent_rank, 1, timeout=60.0)
    assert results[1] is None
    assert results[0] is not None and results[0].startswith(
        "DistError: all_reduce: rank 1 did not arrive within 3 s"
    )


@pytest.mark.slow
def test_dispatch_8_ranks_each_policy():
    pool = Ranks(8)
    try:
        sizes = [3, 0, 5, 2, 7, 1, 0, 4]
        assert_ok(pool.run(exchange_is_a_permutation, [[(s + h) % 3 for h in range(8)] for s in range(8)]))
        for policy, slots, history in (("none", 0, False), ("moonep", 1, False), ("eplb", 1, True)):
            bitwise = policy == "none"
            assert_ok(pool.run(dispatch_matches_one_process, sizes, "hot", policy, slots, history, bitwise))
    finally:
        pool.close()
