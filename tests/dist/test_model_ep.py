"""K3ForCausalLM with expert-parallel MoE layers: logits equal the one-process model's on the
whole batch (bitwise without replicas, 1e-6 with them)."""

from __future__ import annotations

import pytest
from dist_ranks import assert_ok
from dist_workers import generation_matches_one_process, model_logits_match


@pytest.mark.parametrize(
    "preset, policy, quantized, rows",
    [
        ("tiny", "none", True, [2, 1]),
        ("tiny", "moonep", False, [3, 1]),
        ("tiny", "moonep", True, [3, 1]),  # replicas ship MXFP4 codes and scales
        pytest.param("mini", "moonep", False, [1, 1], marks=pytest.mark.slow),  # 25 s on 2 busy cores
        pytest.param("mini", "none", False, [1, 1], marks=pytest.mark.slow),  # bitwise the whole batch
    ],
    ids=["tiny-mxfp4-none", "tiny-moonep-uneven", "tiny-mxfp4-moonep", "mini-moonep", "mini-none"],
)
def test_logits_under_expert_parallelism_equal_one_process(ranks2, preset, policy, quantized, rows):
    assert_ok(ranks2.run(model_logits_match, preset, policy, quantized, rows))


@pytest.mark.parametrize("policy", ["none", "moonep"], ids=["mxfp4-none", "moonep"])
def test_greedy_generation_under_expert_parallelism_equals_one_process(ranks2, policy):
    assert_ok(ranks2.run(generation_matches_one_process, policy))


def test_without_nproc():
    from k3.dist.generate import _without_nproc

    assert _without_nproc(["ckpt", "--nproc", "2", "-p", "x", "--nproc=3"]) == ["ckpt", "-p", "x"]
