"""The MXFP4 matmul with x rounded to int8 per block (k3.ops.mxfp4.int8_x, `int8_inputs=True`).

References: the rounding rule written again here per block in numpy (fp32 arithmetic, round half to even);
the product of the rounded x with the dequantized W in float64; the exact product and the rounding's own
bound. Tolerances are relative to sum |W| |x|: a single code of x rounded differently would move an output by
~1e-3 of it at these sizes, the fp32 sums by ~1e-7.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from k3.model.activations import silu_glu, situ
from k3.ops.mxfp4 import MXFP4Linear, dequantize_mxfp4, experts_one_token, mxfp4_matmul, native_available
from k3.ops.mxfp4.int8_x import quantize_int8_blocks, round_int8_blocks, rounding_bound

needs_native = pytest.mark.skipif(
    not native_available() and os.environ.get("CI") != "true", reason="native kernels not built (k3 doctor)"
)
BACKENDS = ["torch", pytest.param("native", marks=needs_native)]


def random_matrix(n: int, k: int, seed: int, scale_low: int = 115, scale_high: int = 135):
    """packed [n, k/2] with every byte value possible, scale [n, k/32] in [scale_low, scale_high)."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(scale_low, scale_high, (n, k // 32), generator=gen, dtype=torch.uint8)
    return packed, scale


def rounded_product(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, N] float64: the rounded x times W, and sum |W| |x| (the tolerances' scale)."""
    w = dequantize_mxfp4(packed, scale).double()
    return round_int8_blocks(x, torch.float64) @ w.t(), x.double().abs() @ w.abs().t()


def numpy_rounding(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rule block by block: scale = max|x| / 127, code = rint(x * (127 / max|x|)), in float32."""
    codes, scales = np.zeros(x.shape, np.int8), []
    for start in range(0, x.size, 32):
        block = x[start : start + 32].astype(np.float32)
        amax = np.float32(np.abs(block).max())
        if not np.isfinite(block).all():
            scales.append(np.float32("nan"))
        elif amax == 0:
            scales.append(np.float32(0))
        else:
            scales.append(amax / np.float32(127))
            codes[start : start + 32] = np.rint(block * (np.float32(127) / amax))
    return codes, np.array(scales, np.float32)


def test_rounding_follows_the_rule_per_block():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=gen) * torch.logspace(-3, 3, 256)  # blocks of very different sizes
    x[0, 32:64] = 0.0  # a zero block
    x[1, 64] = float("inf")
    x[2, 100] = float("nan")
    codes, scales = quantize_int8_blocks(x)
    for row in range(3):
        want_codes, want_scales = numpy_rounding(x[row].numpy())
        assert np.array_equal(codes[row].numpy(), want_codes)
        np.testing.assert_array_equal(scales[row].numpy(), want_scales)  # NaN where NaN
    assert codes.abs().max() == 127 and torch.isnan(scales).sum() == 2 and (scales == 0).sum() == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,n,k", [(1, 40, 32), (1, 64, 96), (3, 33, 224), (8, 128, 256), (9, 24, 160)])
def test_the_product_is_the_rounded_x_times_w(backend, m, n, k):
    packed, scale = random_matrix(n, k, seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    out = mxfp4_matmul(x, packed, scale, backend=backend, int8_inputs=True)
    want, size = rounded_product(x, packed, scale)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert ((out.double() - want).abs() / size).max() < 2e-6
    exact = mxfp4_matmul(x, packed, scale, backend=backend)
    error = (out - exact).abs().double()
    assert (error <= rounding_bound(x, packed, scale) * (1 + 1e-5) + 1e-6 * size).all()
    assert error.max() > 0  # it does round


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_round_half_to_even(backend):
    """A block whose largest value is 127 has scale 1 and codes round(x): 2.5 -> 2, -3.5 -> -4, 0.5 -> 0.
    W is the identity (element n of row n coded 1.0 = code 2, scale 2^0): the outputs are the codes."""
    x = torch.tensor([[127.0, 2.5, -3.5, 0.5, 1.5, -0.5, 126.5] + [0.0] * 25])
    packed = torch.zeros(32, 16, dtype=torch.uint8)
    for n in range(32):
        packed[n, n // 2] = 2 << (4 * (n % 2))
    scale = torch.full((32, 1), 127, dtype=torch.uint8)
    assert torch.equal(dequantize_mxfp4(packed, scale), torch.eye(32))
    out = mxfp4_matmul(x, packed, scale, backend=backend, int8_inputs=True)
    assert out[0, :7].tolist() == [127.0, 2.0, -4.0, 0.0, 2.0, -0.0, 126.0]


@needs_native
@pytest.mark.parametrize("variant", ["avx2", "auto"])
def test_planted_blocks_and_scales(variant):
    """A zero block of x, an inf in x (NaN out, as the exact path gives), W scale bytes 0 (2^-127) and 255
    (NaN), through each kernel this CPU has (the AVX2 one forced, and the one `auto` picks: VNNI where the
    CPU has it; the two build the weights' scales each their own way)."""
    from k3.ops.mxfp4.native import load_native

    packed, scale = random_matrix(6, 128, seed=1)
    scale[0, 1], scale[1, :] = 0, 0
    scale[2, 3] = 255
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    x[0, :32] = 0.0
    x[2, 70] = float("inf")
    out = load_native().matmul_int8_x(x, packed, scale, variant)
    want, size = rounded_product(x, packed, scale)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan) and nan[2].all() and nan[:, 2].all() and nan.sum() == 6 + 2
    error = (out.double() - want).abs() / size
    assert error[~nan][error[~nan] == error[~nan]].numel() == 18 - 8
    assert error[:, [0, 3, 4, 5]][:2].max() < 2e-6
    # W's row 1, every block at the smallest scale: products below fp32's normal range, computed, not flushed
    assert (out[:2, 1] != 0).all() and (out[:2, 1].abs() < 1e-30).all() and error[:2, 1].max() < 1e-2


@needs_native
def test_bits_do_not_depend_on_threads_or_the_batch():
    packed, scale = random_matrix(300, 512, seed=3)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = mxfp4_matmul(x, packed, scale, int8_inputs=True)
        torch.set_num_threads(2)
        two_threads = mxfp4_matmul(x, packed, scale, int8_inputs=True)
        rows = torch.cat([mxfp4_matmul(x[r : r + 1], packed, scale, int8_inputs=True) for r in range(11)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, two_threads) and torch.equal(rows, two_threads)


@needs_native
@pytest.mark.parametrize("n,k", [(301, 512), (37, 96), (64, 3584), (45, 1056)])
def test_the_vnni_kernel_gives_the_avx2_bits(n, k):
    """A CPU with AVX-512 VNNI takes its own kernel (a group of 16 blocks in one register, one lane a
    block, vpdpbusd): bit for bit the AVX2 kernel's (two 8-lane halves, vpmaddubsw) at 1-11 rows of x, in the
    MXFP4 module and in the decode step's experts, with an odd last row of x, a last group of fewer than 16
    blocks (K = 96: 3 blocks, K = 1056: 2 groups and 1 block), weight rows left over after the blocks of 16
    and a block of x holding a NaN. A CPU without VNNI refuses it (a skip would fail under CI=true, and the
    refusal is what there is to check there)."""
    from k3.ops.decode.native import load_native as load_decode
    from k3.ops.mxfp4.native import load_native

    mxfp4, decode = load_native(), load_decode()
    packed, scale = random_matrix(n, k, seed=n)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-2, 2, k)
    x[6, 3] = float("nan")  # row 6's first block: that row's outputs are all NaN
    if not mxfp4.int8_vnni_supported():  # only the AVX2 kernel runs here: the VNNI one must be refused
        with pytest.raises(RuntimeError, match="lacks AVX-512"):
            mxfp4.matmul_int8_x(x[:4], packed, scale, "avx512")
        return
    for rows in range(1, 12):
        xs = x[:rows].contiguous()
        avx2 = mxfp4.matmul_int8_x(xs, packed, scale, "avx2").view(torch.int32)
        assert torch.equal(mxfp4.matmul_int8_x(xs, packed, scale, "avx512").view(torch.int32), avx2), rows
        for variant in ("avx2", "auto"):
            step = decode.expert_rows(xs, packed, scale, variant=variant, int8_x=True)
            assert torch.equal(step.view(torch.int32), avx2), (rows, variant)
    out = avx2.view(torch.float32)
    assert torch.isnan(out[6]).all() and not torch.isnan(out[:6]).any()
    want, size = rounded_product(x[:6], packed, scale)  # and it is the product (the rows without NaN)
    assert ((out[:6].double() - want).abs() / size).max() < 2e-6


def experts(k: int, latent: int, m: int, seed: int) -> list[tuple[MXFP4Linear, ...]]:
    out = []
    for j in range(k):
        layers = (MXFP4Linear(latent, m), MXFP4Linear(latent, m), MXFP4Linear(m, latent))
        for i, layer in enumerate(layers):
            packed, scale = random_matrix(
                layer.out_features, layer.in_features, seed=seed + 3 * j + i, scale_high=125
            )
            layer.weight_packed.copy_(packed)
            layer.weight_scale.copy_(scale)
            layer.int8_inputs = True
        out.append(layers)
    return out


def experts_reference(z, chosen, weights, activation) -> torch.Tensor:
    """sum_j p_j w2(act(w1 z, w3 z)) in float64, each matrix's input rounded where its int8_inputs say so."""

    def product(x: torch.Tensor, layer: MXFP4Linear) -> torch.Tensor:
        w = dequantize_mxfp4(layer.weight_packed, layer.weight_scale).double()
        return (round_int8_blocks(x, torch.float64) if layer.int8_inputs else x.double()) @ w.t()

    out = torch.zeros(1, z.shape[-1], dtype=torch.float64)
    for (w1, w3, w2), p in zip(chosen, weights.tolist(), strict=True):
        gate, up = product(z, w1).float(), product(z, w3).float()
        hidden = silu_glu(gate, up) if activation is None else situ(gate, up, *activation)
        out += p * product(hidden, w2)
    return out


@pytest.mark.parametrize("activation", [None, (4.0, 25.0)])  # SiLU-GLU, SiTU (beta, linear_beta)
def test_one_tokens_experts_round_every_matrix_input(activation):
    """The native call (int8_x) against float64 products, each matrix's input rounded (the down projection's
    too); and with the down projections exact (the experts' own forwards then: one mode per call)."""
    chosen = experts(4, 256, 96, seed=5)
    z = torch.randn(1, 256, generator=torch.Generator().manual_seed(6))
    weights = torch.tensor([0.4, 0.3, 0.2, 0.1])
    out = experts_one_token(z, chosen, weights, activation)
    want = experts_reference(z, chosen, weights, activation)
    assert ((out.double() - want).abs().max() / want.abs().max()) < 1e-5
    for layers in chosen:
        layers[2].int8_inputs = False
    mixed = experts_one_token(z, chosen, weights, activation)
    want_mixed = experts_reference(z, chosen, weights, activation)
    assert ((mixed.double() - want_mixed).abs().max() / want_mixed.abs().max()) < 1e-5
    assert ((want_mixed - want).abs().max() / want.abs().max()) > 1e-3  # the two references do differ


def test_mxfp4_linear_keeps_the_mode_out_of_its_state():
    layer = MXFP4Linear(64, 8)
    layer.int8_inputs = True
    assert "int8_inputs=True" in repr(layer) and set(layer.state_dict()) == {"weight_packed", "weight_scale"}
    x = torch.randn(2, 64)
    assert torch.equal(layer(x), mxfp4_matmul(x, layer.weight_packed, layer.weight_scale, int8_inputs=True))
