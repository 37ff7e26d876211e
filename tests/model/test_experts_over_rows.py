"""A many-token dispatch in one native call (MoE.experts_over_rows -> k3.ops.decode's `experts_rows`): each
expert's MLP over its block of rows, the experts spread over the threads.

References: float64 products of the experts' exact weights (MXFP4 decoded, or the plain ones) computed here
with the activations of k3.model.activations; for int8 inputs, float64 products of the inputs rounded as
k3.ops.mxfp4.int8_x rounds them; the MoE's expert-by-expert dispatch (`set_fast_decode(False)`, one module
call per expert). A counter on the native module shows the one call really ran (a silent fallback to the
expert-by-expert path would pass every equality), and that it does not run where it must not.
"""

from __future__ import annotations

import os

import pytest
import torch
from native_counting import Counting

import k3.model.moe as moe_module
from k3.config import K3Config
from k3.model.activations import silu_glu, situ
from k3.model.moe import MoE, RoutedExpert, busiest_expert, pairs_by_expert
from k3.ops.decode.native import load_native
from k3.ops.mxfp4 import MXFP4Linear, quantize_mxfp4
from k3.ops.mxfp4.int8_x import round_int8_blocks

needs_native = pytest.mark.skipif(
    load_native() is None and os.environ.get("CI") != "true", reason="native kernels unavailable (k3 doctor)"
)
pytestmark = needs_native

SITU = (4.0, 25.0)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def experts(count: int, L: int, m: int, kind: str, seed: int) -> list[RoutedExpert]:
    """`count` experts with random weights: "mxfp4" (exact or int8 inputs: set later), "fp32" or "bf16"."""
    g = gen(seed)
    made = []
    for _ in range(count):
        expert = RoutedExpert(L, m, silu_glu, quantized=kind == "mxfp4")
        for name, shape in (("w1", (m, L)), ("w3", (m, L)), ("w2", (L, m))):
            w = torch.randn(shape, generator=g) / shape[1] ** 0.5
            matrix = getattr(expert, name)
            if isinstance(matrix, MXFP4Linear):
                matrix.weight_packed, matrix.weight_scale = quantize_mxfp4(w)
            else:
                matrix.weight = torch.nn.Parameter(w.to(torch.bfloat16 if kind == "bf16" else torch.float32))
        made.append(expert)
    return made


def exact_weight(matrix: torch.nn.Module) -> torch.Tensor:
    if isinstance(matrix, MXFP4Linear):
        return matrix.dequantized_weight(torch.float64)
    return matrix.weight.double()


def reference(expert: RoutedExpert, rows: torch.Tensor, act, int8: bool) -> torch.Tensor:
    """w2(act(w1 x, w3 x)) in float64; each matrix's input rounded to int8 per block first when `int8`."""

    def product(matrix: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = round_int8_blocks(x.float(), torch.float64) if int8 else x.double()
        return x @ exact_weight(matrix).t()

    return product(expert.w2, act(product(expert.w1, rows), product(expert.w3, rows)))


def native_rows(
    group: list[RoutedExpert], rows: torch.Tensor, counts: list[int], situ_params
) -> torch.Tensor:
    found = moe_module.native_expert_weights(group)
    assert found is not None
    act = moe_module.native_activation(situ_params)
    return load_native().experts_rows(
        rows, counts, found.dense, found.packed, found.scale, *act, int8_x=found.int8_x
    )


@pytest.mark.parametrize("kind", ["mxfp4", "mxfp4-int8", "fp32", "bf16"])
@pytest.mark.parametrize("situ_params", [None, SITU])
def test_experts_rows_against_float64(kind, situ_params):
    L, m, counts = 96, 64, [3, 0, 9, 1, 17]  # an expert without rows, odd block counts of 32 (L = 3 blocks)
    group = experts(len(counts), L, m, kind.split("-")[0], seed=1)
    int8 = kind == "mxfp4-int8"
    for e in group:
        for matrix in (e.w1, e.w3, e.w2):
            if isinstance(matrix, MXFP4Linear):
                matrix.int8_inputs = int8
    rows = torch.randn(sum(counts), L, generator=gen(2))
    got = native_rows(group, rows, counts, situ_params)
    act = silu_glu if situ_params is None else (lambda g, u: situ(g, u, *situ_params))
    want, start = [], 0
    for e, c in zip(group, counts, strict=True):
        want.append(reference(e, rows[start : start + c], act, int8))
        start += c
    want = torch.cat(want)
    # fp32 sums of 64-96 products against float64 (measured 1.2-2.5e-7). With int8 inputs the reference rounds
    # the same float32 activations: a code on the other side of a tie would cost ~1e-3 (fixed seeds: none)
    assert rel(got, want) <= 2e-6
    assert rel(got, want) > 0  # float32 arithmetic, not a copy of the reference


@pytest.mark.parametrize("kind", ["mxfp4", "mxfp4-int8", "fp32"])
def test_a_rows_value_does_not_depend_on_its_block(kind):
    L, m, counts = 64, 32, [11, 6]
    group = experts(len(counts), L, m, kind.split("-")[0], seed=3)
    for e in group:
        for matrix in (e.w1, e.w3, e.w2):
            if isinstance(matrix, MXFP4Linear):
                matrix.int8_inputs = kind == "mxfp4-int8"
    rows = torch.randn(sum(counts), L, generator=gen(4))
    whole = native_rows(group, rows, counts, SITU)
    first = native_rows(group[:1], rows[:11], [11], SITU)
    for r in (0, 5, 16):  # alone, as one row of the first or of the second expert
        expert, at = (group[:1], r) if r < 11 else (group[1:], r)
        alone = native_rows(expert, rows[at : at + 1], [1], SITU)
        assert torch.equal(alone[0], whole[r])
    assert torch.equal(first, whole[:11])


def test_experts_rows_refuses_counts_that_do_not_add_up():
    group = experts(2, 64, 32, "fp32", seed=5)
    with pytest.raises(RuntimeError, match="counts must add up"):
        native_rows(group, torch.randn(5, 64), [2, 2], None)
    with pytest.raises(RuntimeError, match="one per expert"):
        native_rows(group, torch.randn(5, 64), [5], None)


@pytest.fixture
def counting(monkeypatch) -> Counting:
    counter = Counting(load_native())
    monkeypatch.setattr(moe_module, "load_decode_native", lambda: counter)
    return counter


def mini_moe(quantized: bool) -> MoE:
    cfg = K3Config.preset("mini")
    moe = MoE(cfg, quantized_experts=quantized).eval()
    g = gen(8)
    for e in moe.experts:  # random experts, each its own (a fresh MoE holds zeros)
        for matrix in (e.w1, e.w3, e.w2):
            w = torch.randn(matrix.out_features, matrix.in_features, generator=g) * 0.05
            if isinstance(matrix, MXFP4Linear):
                matrix.weight_packed, matrix.weight_scale = quantize_mxfp4(w)
            else:
                matrix.weight = torch.nn.Parameter(w)
    return moe


def routed(moe: MoE, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, E, k = gen(seed), len(moe.experts), moe.gate.top_k
    z = torch.randn(tokens, moe.experts[0].w1.in_features, generator=g)
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    return z, torch.rand(tokens, k, generator=g), indices


def test_dispatch_in_one_call_equals_expert_by_expert(counting):
    moe = mini_moe(True)
    z, weights, indices = routed(moe, 96, seed=6)
    with torch.no_grad():
        one_call = moe.dispatch(z, weights, indices)
        assert counting.calls["experts_rows"] == 1
        moe.fast_decode = False
        by_expert = moe.dispatch(z, weights, indices)
    assert counting.calls["experts_rows"] == 1  # the expert-by-expert path did not call it
    assert rel(one_call, by_expert) <= 1e-5


def test_plain_experts_keep_the_differentiable_paths_values(counting):
    """Plain experts are a model in training: without gradients its dispatch gives the values of its
    differentiable one, bit for bit (a student scoring its own samples trains on the same numbers)."""
    moe = mini_moe(False)
    z, weights, indices = routed(moe, 96, seed=6)
    with torch.no_grad():
        scored = moe.dispatch(z, weights, indices)
    trained = moe.dispatch(z.requires_grad_(), weights, indices)
    assert counting.calls["experts_rows"] == 0
    assert torch.equal(scored, trained.detach())


def test_dispatch_takes_one_call_only_within_its_limits(counting, monkeypatch):
    moe = mini_moe(True)
    E = len(moe.experts)
    z, weights, indices = routed(moe, 300, seed=7)
    busiest = busiest_expert(pairs_by_expert(indices, E)[1])
    assert moe_module.NATIVE_DISPATCH_ROWS < busiest <= moe_module.NATIVE_DISPATCH_ROWS_SMALL
    with torch.no_grad():
        moe.dispatch(z, weights, indices)
        assert counting.calls["experts_rows"] == 1  # small experts: up to NATIVE_DISPATCH_ROWS_SMALL rows
        monkeypatch.setattr(moe_module, "SMALL_EXPERT_BYTES", 0)  # as if they were K3's
        moe.dispatch(z, weights, indices)
        assert counting.calls["experts_rows"] == 1
        moe.dispatch(z[:4], weights[:4], indices[:4])  # <= NATIVE_DISPATCH_ROWS rows an expert
        assert counting.calls["experts_rows"] == 2
        monkeypatch.setattr(moe_module, "NATIVE_DISPATCH_ROWS_SMALL", busiest - 1)
        monkeypatch.setattr(moe_module, "SMALL_EXPERT_BYTES", 1 << 30)
        moe.dispatch(z, weights, indices)
        assert counting.calls["experts_rows"] == 2
        moe.experts[int(indices[0, 0])].w1.int8_inputs = True  # experts in two modes: each its own forward
        moe.dispatch(z[:4], weights[:4], indices[:4])
        assert counting.calls["experts_rows"] == 2
    moe.dispatch(z[:4], weights[:4], indices[:4])  # gradients recorded: the differentiable path
    assert counting.calls["experts_rows"] == 2


def test_which_experts_the_kernels_take():
    """native_expert_weights: each expert's (w1, w3, w2) in order, MXFP4 with their one int8 mode or plain
    fp32 / BF16; None for mixed kinds, mixed modes or another dtype (each expert then its own forward)."""
    packed, plain = experts(2, 64, 32, "mxfp4", seed=3), experts(2, 64, 32, "fp32", seed=4)
    found = moe_module.native_expert_weights(packed)
    assert found is not None and not found.dense and not found.int8_x
    want = [getattr(e, w).weight_packed for e in packed for w in ("w1", "w3", "w2")]
    assert all(a is b for a, b in zip(found.packed, want, strict=True)) and len(found.scale) == 6
    found = moe_module.native_expert_weights(plain)
    assert found is not None and [w.shape for w in found.dense] == [(32, 64), (32, 64), (64, 32)] * 2
    assert moe_module.native_expert_weights([packed[0], plain[1]]) is None  # mixed kinds
    for matrix in (packed[1].w1, packed[1].w3, packed[1].w2):
        matrix.int8_inputs = True
    assert moe_module.native_expert_weights(packed) is None  # mixed modes
    assert moe_module.native_expert_weights(packed[1:]).int8_x  # type: ignore[union-attr]
    plain[0].w3.weight.data = plain[0].w3.weight.data.half()
    assert moe_module.native_expert_weights(plain) is None  # fp16: not a dtype the kernels read
