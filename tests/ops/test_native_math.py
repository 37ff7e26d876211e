"""The vectorised exp, sigmoid and tanh of k3/ops/_native_math.h, through the decode kernels' gated activation
(`gated_activation`: the MLPs' and experts' act(gate, up), as they apply it).

Reference: the formulas of k3.model.activations evaluated in float64 by torch (an independent libm); and, for
non-finite inputs, the same module in float32 (what the general path gives).
"""

from __future__ import annotations

import pytest
import torch

from k3.model.activations import silu_glu, situ
from k3.ops.decode.native import load_native

SITU = (4.0, 25.0)  # K3's activation_situ_beta, activation_situ_linear_beta


@pytest.fixture(scope="module")
def native():
    module = load_native()
    assert module is not None, "native decode kernels not built: python -m k3.ops.build"
    return module


def spread(n: int, seed: int) -> torch.Tensor:
    """n values from 1e-30 to 200 in magnitude, both signs, with the tanh polynomial's edge (0.625 * 4 for
    g / beta) and sigmoid's underflow (-88) planted."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 10 ** (torch.rand(n, generator=gen, dtype=torch.float64) * 32.3 - 30)
    values = magnitude * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    planted = [2.5, -2.5, 2.4999998, 0.625, -0.625, -88.0, -88.1, -87.9, 88.0, 44.0, -100.0, 0.0]
    planted = torch.tensor(planted)
    return torch.cat([planted.double(), values]).float()


@pytest.mark.parametrize("kind", ["silu_glu", "situ"])
def test_the_activation_against_float64(native, kind):
    g, u = spread(4003, 1), spread(4003, 2).flip(0)  # 4015 values: a tail of 7 after the whole vectors
    if kind == "silu_glu":
        out = native.gated_activation(g, u, 0)
        want = silu_glu(g.double(), u.double())
    else:
        out = native.gated_activation(g, u, 1, *SITU)
        want = situ(g.double(), u.double(), *SITU)
    error = (out.double() - want).abs()
    assert out.dtype == torch.float32 and out.shape == g.shape
    worst = (error / want.abs()).max()
    assert (error <= 1e-6 * want.abs() + 1e-37).all(), f"worst relative error {worst:.2e}"
    normal = want.abs() > 1e-30  # the rest underflow in fp32, the bound's absolute term covers them
    assert normal.sum() > 2000 and (out[normal] != 0).all()


@pytest.mark.parametrize("kind", [0, 1])
def test_non_finite_inputs_as_the_general_path(native, kind):
    """NaN in either input gives NaN; infinities give what the module's torch ops give in float32 (SiLU-GLU:
    -inf * sigmoid(-inf) = -inf * 0 = NaN)."""
    inf, nan = float("inf"), float("nan")
    g = torch.tensor([nan, 1.0, inf, -inf, inf, -inf, 3.0, -200.0, 0.5])
    u = torch.tensor([1.0, nan, 2.0, 2.0, -inf, inf, inf, 1.0, -0.0])
    if kind == 0:
        out, want = native.gated_activation(g, u, 0), silu_glu(g, u)
    else:
        out, want = native.gated_activation(g, u, 1, *SITU), situ(g, u, *SITU)
    assert torch.equal(torch.isnan(out), torch.isnan(want)), (out, want)
    finite = ~torch.isnan(want)
    assert torch.allclose(out[finite], want[finite], rtol=2e-6, atol=0.0), (out, want)


def test_a_value_gives_the_same_bits_anywhere(native):
    """Each value goes through the vector code, a tail padded: its bits do not depend on its position, the
    length (whole vectors or a tail) or its neighbours."""
    g, u = spread(53, 3), spread(53, 4)
    whole = native.gated_activation(g, u, 1, *SITU)
    for start, stop in [(5, 53), (0, 3), (17, 24), (40, 49), (1, 2)]:
        part = native.gated_activation(g[start:stop].clone(), u[start:stop].clone(), 1, *SITU)
        assert torch.equal(part, whole[start:stop]), (start, stop)
    shuffled = torch.randperm(53, generator=torch.Generator().manual_seed(5))
    assert torch.equal(native.gated_activation(g[shuffled], u[shuffled], 1, *SITU), whole[shuffled])


@pytest.mark.parametrize("kind", [0, 1])
def test_bf16_is_the_fp32_result_rounded_once(native, kind):
    """bfloat16 g and u: each widened exactly, the fp32 activation of the same values, rounded to bfloat16 as
    torch rounds (to nearest even; NaN a NaN): bit for bit, ties and non-finite values planted."""
    args = (kind, *SITU) if kind else (kind,)
    g, u = spread(4003, 6).bfloat16(), spread(4003, 7).flip(0).bfloat16()
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40]).bfloat16()
    g, u = torch.cat([special, g, special.flip(0)]), torch.cat([special.flip(0), u, special])
    out = native.gated_activation(g, u, *args)
    want = native.gated_activation(g.float(), u.float(), *args).bfloat16()
    assert out.dtype == torch.bfloat16 and out.shape == g.shape
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.isnan(out).any()
    assert torch.equal(out.view(torch.int16)[~torch.isnan(out)], want.view(torch.int16)[~torch.isnan(want)])
    # one rounding: within half a bfloat16 step (2^-8 relative) of float64
    reference = (situ(g.double(), u.double(), *SITU) if kind else silu_glu(g.double(), u.double())).float()
    finite = torch.isfinite(reference) & (reference.abs() > 1e-30)
    error = ((out.double() - reference.double()).abs() / reference.double().abs())[finite]
    assert error.max() <= 2**-8 + 1e-6, error.max()


def test_many_rows_split_across_threads_give_the_same_bits(native):
    """A prefill's activation: 300 x 1000 values (whole vectors and a tail per thread's share) at 1 and 2
    threads, and each row alone, bit for bit, fp32 and bf16."""
    g, u = spread(299_988, 8).view(300, 1000), spread(299_988, 9).view(300, 1000)  # 12 planted each
    threads = torch.get_num_threads()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            a, b = g.to(dtype), u.to(dtype)
            torch.set_num_threads(1)
            one = native.gated_activation(a, b, 1, *SITU)
            torch.set_num_threads(2)
            two = native.gated_activation(a, b, 1, *SITU)
            assert torch.equal(one, two)
            for row in (0, 137, 299):
                assert torch.equal(native.gated_activation(a[row], b[row], 1, *SITU), two[row])
    finally:
        torch.set_num_threads(threads)


def test_refusals(native):
    with pytest.raises(RuntimeError, match="one shape"):
        native.gated_activation(torch.zeros(4), torch.zeros(5), 0)
    with pytest.raises(RuntimeError, match="both fp32 or both bfloat16"):
        native.gated_activation(torch.zeros(4), torch.zeros(4).bfloat16(), 0)
    with pytest.raises(RuntimeError, match="both fp32 or both bfloat16"):
        native.gated_activation(torch.zeros(4).half(), torch.zeros(4).half(), 0)
