"""MXFP4 codec, packed matmul and value counts against independent references.

Oracles: compressed-tensors 0.20.0 (decoder and packer), transformers 5.23.0's gpt-oss dequantizer,
and a slow per-element implementation of the OCP MX v1.0 rule written here with exact fractions.
"""

from __future__ import annotations

import math
import types
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from k3.ops.extension import NativeExtension, native_status
from k3.ops.mxfp4 import (
    MXFP4Linear,
    dequantize_mxfp4,
    mxfp4_matmul,
    mxfp4_value_counts,
    native_available,
    quantize_mxfp4,
)
from k3.ops.mxfp4.native import load_native

E2M1_MAGNITUDES = [Fraction(v) for v in ("0", "0.5", "1", "1.5", "2", "3", "4", "6")]

CT_SCHEME = QuantizationScheme(
    targets=["Linear"],
    weights=QuantizationArgs(
        num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, scale_dtype=torch.uint8
    ),
)

BACKENDS = [
    "torch",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(
            not native_available(), reason="native kernels not built: python -m k3.ops.build"
        ),
    ),
]


def all_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """packed [255, 256] and scale [255, 16]: row r has scale byte r and every byte value once."""
    gen = torch.Generator().manual_seed(0)
    packed = torch.stack([torch.randperm(256, generator=gen) for _ in range(255)]).to(torch.uint8)
    scale = torch.arange(255, dtype=torch.uint8)[:, None].expand(255, 16).contiguous()
    return packed, scale


def random_pairs(rows: int, cols: int, seed: int, scale_low: int = 0, scale_high: int = 255):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(scale_low, scale_high, (rows, cols // 32), generator=gen, dtype=torch.uint8)
    return packed, scale


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (distinguishes -0 from +0, equates identical NaNs)."""
    int_dtype = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}[a.dtype]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(int_dtype), b.view(int_dtype))


# ----------------------------------------------------------------------------------------------- decoding


def test_decoding_matches_compressed_tensors_on_every_byte_and_scale():
    packed, scale = all_pairs()
    theirs = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, CT_SCHEME)
    assert theirs["weight"].dtype == torch.bfloat16
    assert same_bits(dequantize_mxfp4(packed, scale, torch.bfloat16), theirs["weight"])
    # bfloat16 holds every decoded value exactly, so the float32 decode agrees too
    assert same_bits(dequantize_mxfp4(packed, scale).to(torch.bfloat16), theirs["weight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_matches_transformers_gpt_oss_dequantizer(dtype):
    packed, scale = all_pairs()
    n, k = packed.shape[0], 2 * packed.shape[1]
    # transformers takes blocks [experts, rows, groups, 16] and returns the transpose [experts, K, rows]
    blocks = packed.reshape(1, n, k // 32, 16)
    theirs = convert_moe_packed_tensors(blocks, scale.reshape(1, n, k // 32), dtype=dtype)[0].t()
    assert same_bits(dequantize_mxfp4(packed, scale, dtype), theirs.contiguous())


def test_decoding_special_scales_and_batched_shapes():
    packed = torch.full((2, 3, 16), 0x71, dtype=torch.uint8)  # low nibble 1 (0.5), high nibble 7 (6)
    scale = torch.tensor([0, 127, 255], dtype=torch.uint8).expand(2, 3)[..., None].contiguous()
    out = dequantize_mxfp4(packed, scale, torch.float64)
    assert out.shape == (2, 3, 32)
    assert out[0, 0, 0] == 2.0**-128 and out[0, 0, 1] == 6 * 2.0**-127
    assert out[1, 1, 0] == 0.5 and out[1, 1, 1] == 6.0
    assert out[:, 2].isnan().all()
    assert dequantize_mxfp4(packed, scale, torch.float16).dtype == torch.float16


# ----------------------------------------------------------------------------------------------- encoding


def floor_log2(value: Fraction) -> int:
    """floor(log2(value)) for value > 0, exactly."""
    e = value.numerator.bit_length() - value.denominator.bit_length()
    while Fraction(2) ** e > value:
        e -= 1
    while Fraction(2) ** (e + 1) <= value:
        e += 1
    return e


def reference_quantize(w: torch.Tensor) -> list[float]:
    """Slow OCP MX v1.0 rule, one Fraction at a time; returns the dequantized values (exact floats)."""
    out: list[float] = []
    for block in w.double().reshape(-1, 32).tolist():
        exact = [Fraction(v) for v in block]
        amax = max(abs(v) for v in exact)
        shared = -127 if amax == 0 else min(127, max(-127, floor_log2(amax) - 2))
        scale = Fraction(2) ** shared
        for v, raw in zip(exact, block, strict=True):
            y = abs(v) / scale
            # nearest magnitude; on a tie the even code (index) wins; beyond 6 the nearest is 6 (saturation)
            code = min(range(8), key=lambda c: (abs(y - E2M1_MAGNITUDES[c]), c % 2))
            value = float(E2M1_MAGNITUDES[code] * scale)  # exact: a small integer times a power of two
            out.append(-value if math.copysign(1.0, raw) < 0 else value)
    return out


def encoding_cases() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    ties = torch.zeros(4, 32, dtype=torch.float64)
    for row, k in enumerate((0, -20, 30, -126)):
        # amax 4 * 2^k sets the scale to exactly 2^k, so every midpoint times 2^k is an exact tie
        ties[row, 0] = 4.0
        ties[row, 1:8], ties[row, 8:15] = midpoints, -midpoints
        ties[row, 15:22] = midpoints + 2.0**-20  # just above each tie
        ties[row, 22:29] = midpoints - 2.0**-20  # just below
        ties[row] *= 2.0**k
    subnormal = torch.randint(-(2**10), 2**10, (4, 32), generator=gen).double() * 2.0**-149  # fp32 subnormals
    saturating = torch.randn(4, 32, generator=gen, dtype=torch.float64)
    saturating[:, 0] = torch.tensor([7.0, 7.99, 1.75 * 2**10, 3.9999]) * torch.tensor([1, -1, 1, -1])
    magnitudes = 2.0 ** torch.randint(-140, 120, (16, 1), generator=gen).double()
    return {
        "random float32": torch.randn(8, 64, generator=gen).float() * 3,
        "ties float32": ties.float(),
        "subnormal-sized float32": subnormal.float(),
        "saturation float32": saturating.float(),
        "huge and tiny float32": (
            torch.randn(16, 32, generator=gen, dtype=torch.float64) * magnitudes
        ).float(),
        "zeros and signed zeros": torch.tensor([0.0, -0.0] * 16).reshape(1, 32),
        "huge float64 (clamped exponent)": torch.randn(2, 32, generator=gen, dtype=torch.float64) * 1e300,
        "tiny float64 (clamped exponent)": torch.randn(2, 32, generator=gen, dtype=torch.float64) * 1e-300,
        "bfloat16": torch.randn(3, 2, 64, generator=gen).to(torch.bfloat16),
        "float16": torch.randn(2, 96, generator=gen).half() * 1000,
    }


@pytest.mark.parametrize("case", list(encoding_cases()))
def test_quantize_matches_reference_rule(case):
    w = encoding_cases()[case]
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (*w.shape[:-1], w.shape[-1] // 2) and packed.dtype == torch.uint8
    assert scale.shape == (*w.shape[:-1], w.shape[-1] // 32) and scale.dtype == torch.uint8
    decoded = dequantize_mxfp4(packed, scale, torch.float64).reshape(-1)
    expected = torch.tensor(reference_quantize(w), dtype=torch.float64)
    assert torch.equal(decoded, expected)
    assert torch.equal(decoded.signbit(), expected.signbit())  # negatives rounded to zero stay -0


def test_all_zero_block_gets_scale_byte_zero():
    w = torch.zeros(2, 64)
    w[1, 32:] = torch.linspace(-1, 1, 32)
    packed, scale = quantize_mxfp4(w)
    assert scale[0].tolist() == [0, 0] and scale[1, 0] == 0
    assert torch.equal(dequantize_mxfp4(packed, scale)[:, :32], torch.zeros(2, 32))


def test_k3_encoding_decodes_identically_with_compressed_tensors():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(2)) * 0.02
    packed, scale = quantize_mxfp4(w)
    theirs = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, CT_SCHEME)
    assert same_bits(theirs["weight"], dequantize_mxfp4(packed, scale, torch.bfloat16))


def test_compressed_tensors_packing_matches_k3_given_the_same_scales():
    """compressed-tensors rounds elements like k3 (ties to even, saturate at 6): same bytes, same decode."""
    w = encoding_cases()["ties float32"]
    w = torch.cat([w, torch.randn(12, 32, generator=torch.Generator().manual_seed(3))])
    packed, scale = quantize_mxfp4(w)
    float_scale = torch.tensor([[math.ldexp(1.0, s - 127) for s in row] for row in scale.tolist()])  # [N, G]
    theirs = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": float_scale}, CT_SCHEME)
    assert torch.equal(theirs["weight_scale"], scale)
    assert torch.equal(theirs["weight_packed"], packed)
    assert same_bits(
        dequantize_mxfp4(theirs["weight_packed"], theirs["weight_scale"]), dequantize_mxfp4(packed, scale)
    )


def test_compressed_tensors_scale_rule_differs_only_for_amax_mantissa_at_least_1_75():
    """Documented difference: compressed-tensors' observer rounds amax's mantissa >= 1.75 up to the next
    power of two before taking floor(log2) - 2, where OCP (and k3) floors; below 1.75 the bytes agree."""
    mantissas = torch.tensor([1.0, 1.25, 1.5, 1.74, 1.75, 1.9, 1.999])
    amax = (mantissas[:, None] * 2.0 ** torch.tensor([-10.0, 0.0, 7.0])).reshape(-1, 1)  # [21, 1]
    w = torch.zeros(21, 32)
    w[:, 5] = amax[:, 0]
    _, scale = quantize_mxfp4(w)
    theirs = generate_mx_scales(amax).to(torch.int32)
    rounds_up = (mantissas >= 1.75).repeat_interleave(3)[:, None]
    assert torch.equal(theirs, scale.to(torch.int32) + rounds_up.to(torch.int32))


# ----------------------------------------------------------------------------------------------- matmul


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 3, 64, 257])
def test_matmul_matches_dequantize_then_matmul(backend, m):
    # K = 4192 is not a multiple of any tile width (native 4096, torch 2048); N = 300 not of 128 or 256
    n, k = 300, 4192
    gen = torch.Generator().manual_seed(m)
    packed, scale = random_pairs(n, k, seed=m, scale_low=118, scale_high=130)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    expected = x.double() @ dequantize_mxfp4(packed, scale, torch.float64).t() + bias.double()
    out = mxfp4_matmul(x, packed, scale, bias, backend=backend)
    assert out.shape == (m, n) and out.dtype == torch.float32
    rel = (out.double() - expected).norm() / expected.norm()
    assert rel <= 1e-5


@pytest.mark.skipif(not native_available(), reason="native kernels not built")
@pytest.mark.parametrize("m", [2, 8, 9, 20])
def test_native_paths_with_small_tiles(m):
    """Both native paths (streaming and tiled) on tiles that do not divide the matrix."""
    n, k = 70, 224
    packed, scale = random_pairs(n, k, seed=10 + m, scale_low=120, scale_high=134)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    expected = x.double() @ dequantize_mxfp4(packed, scale, torch.float64).t()
    native = load_native()
    for gemv_max_m in (0, m):
        out = native.matmul(x, packed, scale, gemv_max_m=gemv_max_m, tile_n=32, tile_k=96)
        assert (out.double() - expected).norm() / expected.norm() <= 1e-5


@pytest.mark.skipif(not native_available(), reason="native kernels not built")
def test_native_gemv_variants_and_thread_counts_give_the_same_bits():
    """The AVX-512 GEMVs run every lane's operations in the AVX2 order: same bits, at any thread count.
    Odd block counts (7, 131) exercise the AVX2 tail; -0 inputs, subnormal, huge and NaN scales planted.
    (The default path, AVX-512 where the CPU has it, is checked against float64 products above.)"""
    native = load_native()
    variants = ["avx2", "avx512"] if native.gemv_variant() == "avx512" else ["avx2"]
    threads = torch.get_num_threads()
    for n, k in [(70, 224), (33, 4192), (40, 3584)]:
        packed, scale = random_pairs(n, k, seed=k, scale_low=90, scale_high=160)
        scale[0, 3], scale[1], scale[2, 1] = 255, 0, 254  # NaN; 2^-127 (subnormal products); 2^127
        for m in range(1, 10):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            x *= 2.0 ** torch.randint(-8, 8, (k,), generator=torch.Generator().manual_seed(-m))
            x[:, ::7] = -0.0
            outs = []
            for variant in variants:
                for t in sorted({1, max(2, threads)}):
                    torch.set_num_threads(t)
                    try:
                        outs.append(
                            native.matmul(
                                x, packed, scale, gemv_max_m=9, tile_n=32, tile_k=96, variant=variant
                            )
                        )
                    finally:
                        torch.set_num_threads(threads)
            assert all(same_bits(out, outs[0]) for out in outs[1:]), (n, k, m)
            assert outs[0][:, 0].isnan().all() and outs[0][:, 3:].isfinite().all()
            assert (outs[0][:, 1].abs() < 1e-30).all() and (outs[0][:, 1] != 0).any()
    with pytest.raises(RuntimeError, match="variant"):
        native.matmul(x, packed, scale, gemv_max_m=9, tile_n=32, tile_k=96, variant="sse")


@pytest.mark.skipif(not native_available(), reason="native kernels not built")
@pytest.mark.parametrize("act", [0, 1])
def test_native_experts_one_token_variants_give_the_same_bits(act):
    """One token's routed experts (one-row GEMVs) with the AVX-512 and the AVX2 GEMV: the same bits.
    L = 96 is 3 blocks (w1 and w3 end on an unpaired block), m = 64 is 2."""
    native = load_native()
    k, L, m = 3, 96, 64
    packed, scale = [], []
    for i in range(3 * k):
        rows, cols = (L, m) if i % 3 == 2 else (m, L)
        p, s = random_pairs(rows, cols, seed=100 + i, scale_low=118, scale_high=130)
        packed.append(p)
        scale.append(s)
    z = torch.randn(1, L, generator=torch.Generator().manual_seed(1))
    weights = torch.rand(k, generator=torch.Generator().manual_seed(2))
    outs = [
        native.experts_one_token(z, packed, scale, weights, act, 3.0, 5.0, variant=v)
        for v in (["avx2", "avx512"] if native.gemv_variant() == "avx512" else ["avx2"])
    ]
    assert outs[0].abs().max() > 0 and all(same_bits(out, outs[0]) for out in outs[1:])


@pytest.mark.skipif(not native_available(), reason="native kernels not built")
def test_native_bf16_tiles_decode_every_value_exactly():
    """x = the identity (bf16, many rows: the bf16 tiled path) gives W^T: each output one product of 1 with
    a weight, so only an inexact bf16 decoding of a weight could change it. Every byte under every scale
    whose values are normal and finite in fp32 (bytes 2-252: bf16 dot-product instructions flush
    subnormals, and 0 x inf would be NaN), with small tiles (3 of K)."""
    packed, scale = all_pairs()  # [255, 256], [255, 16]: W is [255, 512], row r under scale byte r
    packed, scale = packed[2:253].contiguous(), scale[2:253].contiguous()
    eye = torch.eye(512, dtype=torch.bfloat16)
    out = load_native().matmul(eye, packed, scale, gemv_max_m=8, tile_n=32, tile_k=160)  # [512, 251]
    expected = dequantize_mxfp4(packed, scale, torch.float32).t()  # exact in fp32
    assert out.dtype == torch.bfloat16 and torch.equal(out.float(), expected)  # (-0 sums to +0)
    nan_scale = torch.full((4, 16), 255, dtype=torch.uint8)
    assert load_native().matmul(eye, packed[:4], nan_scale, gemv_max_m=8, tile_n=32, tile_k=160).isnan().all()


@pytest.mark.parametrize("m", [9, 257])
def test_bf16_input_with_many_rows_is_multiplied_in_bf16(m):
    """Many rows of bf16 x on the native path: bf16 products (exact: both factors are bf16), fp32 sums,
    one rounding to bf16; against float64 products of the same bf16 values. K = 4192 spans two native
    tiles of K (4096): the bf16 tile must span all of K, or partial sums would be rounded twice."""
    if not native_available():
        pytest.skip("native kernels not built")
    n, k = 300, 4192
    packed, scale = random_pairs(n, k, seed=m, scale_low=118, scale_high=130)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    expected = x.double() @ dequantize_mxfp4(packed, scale, torch.float64).t()  # [m, n]
    out = mxfp4_matmul(x, packed, scale, backend="native")
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # one bf16 rounding (2^-9 relative) plus fp32 sums of 4192 products
    assert ((out.double() - expected).abs() <= expected.abs() * 2.0**-8 + 1e-5 * expected.abs().max()).all()


@pytest.mark.skipif(not native_available(), reason="native kernels not built")
def test_native_bf16_gemv_against_float64_and_its_bits_alone_and_in_a_batch():
    """Few rows of a bf16 x: bf16 dot products (AVX-512 BF16) or, on CPUs without them, the fp32 GEMV of
    the same values. Against float64 products of the same bf16 values (exact) within one bf16 rounding
    and fp32 sums; the same bits at 1 or 2 threads, and with bf16 dot products a row's bits alone equal
    its bits in a batch of 8 (each output summed in one order by one thread). Odd block counts and a NaN
    scale planted."""
    native = load_native()
    threads = torch.get_num_threads()
    for n, k in [(70, 224), (33, 4192), (40, 3584)]:
        packed, scale = random_pairs(n, k, seed=k + 1, scale_low=110, scale_high=140)
        scale[0, 3] = 255  # NaN
        x = torch.randn(8, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
        expected = x.double() @ dequantize_mxfp4(packed, scale, torch.float64).t()  # [8, n]
        outs = []
        for t in sorted({1, max(2, threads)}):
            torch.set_num_threads(t)
            try:
                outs.append(native.matmul(x, packed, scale, gemv_max_m=8, tile_n=32, tile_k=96))
                alone = [
                    native.matmul(x[r : r + 1], packed, scale, gemv_max_m=8, tile_n=32, tile_k=96)
                    for r in range(8)
                ]
            finally:
                torch.set_num_threads(threads)
            if native.bf16_gemv_supported():  # (the fp32 fallback runs another kernel for one row)
                assert all(same_bits(alone[r][0], outs[-1][r]) for r in range(8)), (n, k, t)
        assert outs[0].dtype == torch.bfloat16 and all(same_bits(o, outs[0]) for o in outs[1:])
        assert outs[0][:, 0].isnan().all()
        got, want = outs[0][:, 1:].double(), expected[:, 1:]
        assert ((got - want).abs() <= want.abs() * 2.0**-8 + 1e-5 * want.abs().max()).all(), (n, k)
        if not native.bf16_gemv_supported():  # the fallback: the fp32 GEMV's result, rounded
            fp32 = native.matmul(x.float(), packed, scale, gemv_max_m=8, tile_n=32, tile_k=96)
            assert same_bits(outs[0], fp32.to(torch.bfloat16))


@pytest.mark.skipif(not native_available(), reason="native kernels not built")
def test_native_tiled_path_runs_under_inference_mode():
    """The tiled path's worker threads update an inference tensor: they must run in inference mode too."""
    n, k, m = 300, 4192, 257  # m above the GEMV limit: the tiled path, split across threads
    packed, scale = random_pairs(n, k, seed=5, scale_low=118, scale_high=130)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = mxfp4_matmul(x, packed, scale, backend="native")
    with torch.inference_mode():
        out = mxfp4_matmul(x, packed, scale, backend="native")
    assert torch.equal(out, expected)


@pytest.mark.skipif(not native_available(), reason="native kernels not built")
def test_stale_native_build_is_ignored_and_torch_path_is_used(monkeypatch):
    """A module whose compiled-in digest is not its sources' is not used (the torch path is)."""
    packed, scale = random_pairs(16, 64, seed=6, scale_low=120, scale_high=130)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6))
    real_import = NativeExtension.import_module

    def stale_import(self, path):
        module = real_import(self, path)
        return types.SimpleNamespace(source_hash="0" * 16, cpu_supported=module.cpu_supported)

    monkeypatch.setattr(NativeExtension, "import_module", stale_import)
    load_native.cache_clear()
    native_status.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="older _native.cpp"):
            assert not native_available()
        assert torch.equal(mxfp4_matmul(x, packed, scale), mxfp4_matmul(x, packed, scale, backend="torch"))
        with pytest.raises(RuntimeError, match="not available"):
            mxfp4_matmul(x, packed, scale, backend="native")
    finally:
        monkeypatch.undo()
        load_native.cache_clear()
        native_status.cache_clear()
    assert native_available()


@pytest.mark.parametrize("backend", BACKENDS)
def test_matmul_batched_input_and_dtype(backend):
    packed, scale = random_pairs(48, 64, seed=5, scale_low=120, scale_high=130)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out = mxfp4_matmul(x, packed, scale, backend=backend)
    assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16
    expected = x.float() @ dequantize_mxfp4(packed, scale).t()
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_mxfp4_linear_round_trip_and_state_dict():
    linear = torch.nn.Linear(96, 40, bias=True)
    layer = MXFP4Linear.from_float(linear)
    assert set(layer.state_dict()) == {"weight_packed", "weight_scale", "bias"}
    assert layer.weight_packed.shape == (40, 48) and layer.weight_scale.shape == (40, 3)
    packed, scale = quantize_mxfp4(linear.weight.detach())
    assert torch.equal(layer.weight_packed, packed) and torch.equal(layer.weight_scale, scale)
    x = torch.randn(5, 96)
    expected = F.linear(x, dequantize_mxfp4(packed, scale), linear.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)

    fresh = MXFP4Linear(96, 40, bias=True)
    assert torch.equal(fresh(x), torch.zeros(5, 40))
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x), layer(x))
    no_bias = MXFP4Linear.from_float(linear.weight)
    assert no_bias.bias is None and "bias=False" in repr(no_bias)


# ----------------------------------------------------------------------------------------------- value counts


def assert_counts_match_unique(packed: torch.Tensor, scale: torch.Tensor):
    stats = mxfp4_value_counts(packed, scale)
    values, counts = torch.unique(dequantize_mxfp4(packed, scale, torch.float64), return_counts=True)
    assert torch.equal(stats.values, values) and stats.values.dtype == torch.float64
    assert torch.equal(stats.counts, counts) and stats.counts.dtype == torch.int64
    codes = torch.stack((packed & 15, packed >> 4), -1).flatten()
    assert torch.equal(stats.code_histogram, torch.bincount(codes.long(), minlength=16))
    assert torch.equal(stats.scale_histogram, torch.bincount(scale.flatten().long(), minlength=256))
    return stats


@pytest.mark.parametrize("scale_range", [(0, 255), (125, 129), (126, 127)])
def test_value_counts_match_unique_on_random_matrices(scale_range):
    packed, scale = random_pairs(
        64, 256, seed=sum(scale_range), scale_low=scale_range[0], scale_high=scale_range[1]
    )
    assert_counts_match_unique(packed, scale)


def test_value_counts_on_a_planted_matrix_with_21_values():
    """Scales s and s+1 with every code, plus scale s+2 with code 7 only: magnitudes
    {.5 1 1.5 2 3 4 6 8 12 24} times 2^(s-127), so 10 signed pairs and zero = 21 values
    (1.0 at s equals 0.5 at s+1, and so on, so they merge)."""
    s = 120
    gen = torch.Generator().manual_seed(21)
    codes = torch.randint(0, 16, (30, 128), generator=gen, dtype=torch.uint8)
    codes[:, :16] = torch.arange(16, dtype=torch.uint8)  # every code in the first block of each row
    scale = torch.full((30, 4), s, dtype=torch.uint8)
    scale[::2, 1] = s + 1
    scale[:, 2], scale[:, 3] = s + 1, s + 2
    codes[:, 96:] = torch.where(torch.rand(30, 32, generator=gen) < 0.5, 7, 15).to(torch.uint8)
    codes[0, 32:64] = torch.arange(32, dtype=torch.uint8) % 16  # all codes at scale s+1 too
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    stats = assert_counts_match_unique(packed, scale)
    magnitudes = torch.tensor([0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 24], dtype=torch.float64) * 2.0 ** (s - 127)
    assert stats.num_distinct == 21
    assert torch.equal(
        stats.values, torch.cat([-magnitudes.flip(0), torch.zeros(1, dtype=torch.float64), magnitudes])
    )
    assert int(stats.counts.sum()) == codes.numel()


def test_value_counts_merge_signed_zeros_and_nan_scales():
    packed = torch.tensor([[0x80] * 16, [0x08] * 16, [0x11] * 16], dtype=torch.uint8)  # +0/-0, and 0.5s
    scale = torch.tensor([[3], [200], [255]], dtype=torch.uint8)
    stats = mxfp4_value_counts(packed, scale)
    assert stats.values[0] == 0.0 and stats.counts[0] == 64
    assert stats.values[1].isnan() and stats.counts[1] == 32
    assert stats.num_distinct == 2


# ----------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("w", "message"),
    [
        (torch.tensor([float("nan")] + [0.0] * 31), "NaN or infinite"),
        (torch.tensor([float("inf")] + [0.0] * 31), "NaN or infinite"),
        (torch.zeros(4, 48), "multiple of 32"),
        (torch.zeros(4, 0), "multiple of 32"),
        (torch.zeros(4, 32, dtype=torch.int32), "floating-point"),
        (torch.tensor(1.0), "multiple of 32"),
    ],
)
def test_quantize_rejects_bad_input(w, message):
    with pytest.raises(ValueError, match=message):
        quantize_mxfp4(w)


@pytest.mark.parametrize(
    ("packed", "scale", "message"),
    [
        (torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8), "packed must be uint8"),
        (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1), "scale must be uint8"),
        (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), "inconsistent"),
        (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(5, 1, dtype=torch.uint8), "inconsistent"),
        (torch.zeros(4, 17, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), "inconsistent"),
        (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), "inconsistent"),
        (torch.zeros((), dtype=torch.uint8), torch.zeros((), dtype=torch.uint8), "at least one dimension"),
    ],
)
def test_packed_inputs_are_validated(packed, scale, message):
    for call in (
        lambda: dequantize_mxfp4(packed, scale),
        lambda: mxfp4_value_counts(packed, scale),
        lambda: mxfp4_matmul(torch.zeros(1, 32), packed, scale),
    ):
        with pytest.raises(ValueError, match=message):
            call()


def test_matmul_rejects_mismatched_operands():
    packed, scale = random_pairs(8, 64, seed=0)
    with pytest.raises(ValueError, match="does not match"):
        mxfp4_matmul(torch.zeros(2, 32), packed, scale)
    with pytest.raises(ValueError, match="bias"):
        mxfp4_matmul(torch.zeros(2, 64), packed, scale, torch.zeros(7))
    with pytest.raises(ValueError, match="floating-point"):
        mxfp4_matmul(torch.zeros(2, 64, dtype=torch.int64), packed, scale)
    with pytest.raises(ValueError, match="matrix"):
        mxfp4_matmul(torch.zeros(2, 64), packed[None], scale[None])
    with pytest.raises(ValueError, match="backend"):
        mxfp4_matmul(torch.zeros(2, 64), packed, scale, backend="cuda")
    with pytest.raises(ValueError, match="dtype"):
        dequantize_mxfp4(packed, scale, torch.int32)
    with pytest.raises(ValueError, match="in_features"):
        MXFP4Linear(48, 8)


@pytest.mark.skipif(not native_available(), reason="native kernels not built")
def test_native_histograms_equal_bincount():
    native = load_native()
    gen = torch.Generator().manual_seed(4)
    data = torch.randint(-(1 << 15), 1 << 15, (100_003,), generator=gen, dtype=torch.int32).to(torch.int16)
    out = torch.full((1 << 16,), 5, dtype=torch.int64)  # counts are added to what is there
    native.histogram_u16(data, out)
    expected = torch.bincount(data.to(torch.int32) & 0xFFFF, minlength=1 << 16) + 5
    assert torch.equal(out, expected)

    packed = torch.randint(0, 256, (999, 16), generator=gen, dtype=torch.uint8)
    scale = torch.randint(0, 256, (999,), generator=gen, dtype=torch.uint8)
    out = torch.zeros(1 << 16, dtype=torch.int64)
    native.histogram_scaled_bytes(packed, scale, out)
    keys = scale.to(torch.int64).view(-1, 1) * 256 + packed.to(torch.int64)
    assert torch.equal(out, torch.bincount(keys.view(-1), minlength=1 << 16))
    with pytest.raises(RuntimeError, match="16 bytes per scale"):
        native.histogram_scaled_bytes(packed.view(-1)[: 999 * 8], scale, out)
    with pytest.raises(RuntimeError, match="65,536"):
        native.histogram_u16(data, torch.zeros(10, dtype=torch.int64))


def test_byte_pair_decoding_equals_nibble_unpacking() -> None:
    """dequantize_mxfp4 looks both values of a byte up at once; against unpacking nibbles into codes."""
    gen = torch.Generator().manual_seed(6)
    packed = torch.randint(0, 256, (37, 64), dtype=torch.uint8, generator=gen)
    scale = torch.randint(0, 256, (37, 4), dtype=torch.uint8, generator=gen)
    scale[0] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)  # extremes, overflow to inf, NaN
    code_values = torch.tensor([float(m) for m in E2M1_MAGNITUDES] + [-float(m) for m in E2M1_MAGNITUDES])
    scale_values = torch.tensor([math.ldexp(1.0, s - 127) for s in range(255)] + [math.nan])
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()  # [37, 128]
    values = code_values[codes].view(37, 4, 32) * scale_values[scale.long()][..., None]
    torch.testing.assert_close(
        dequantize_mxfp4(packed, scale), values.view(37, 128), rtol=0, atol=0, equal_nan=True
    )
