"""The statistics accumulators against direct computations on the whole tensor (torch.unique, sums)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from k3.atlas.similarity import cosine_similarities, expert_pairs
from k3.atlas.stats import BitPatternStats, MXFP4Stats, StreamingStats, stats_from_value_table
from k3.ops.mxfp4 import dequantize_mxfp4, native_available, quantize_mxfp4


def reference(x: torch.Tensor) -> dict[str, float]:
    """Statistics of x computed directly (NaNs excluded from the moments, counted apart)."""
    v = x.double().flatten()
    nan = v.isnan()
    v = v[~nan]
    n = v.numel()
    return {
        "distinct": torch.unique(v + 0.0).numel() + int(nan.any()),
        "min": float(v.min()),
        "max": float(v.max()),
        "mean": float(v.sum() / n),
        "mean_abs": float(v.abs().sum() / n),
        "rms": math.sqrt(float((v * v).sum() / n)),
        "zero_fraction": float((v == 0).sum()) / x.numel(),
        "nan_count": int(nan.sum()),
    }


def check(record: dict, ref: dict[str, float]) -> None:
    assert record["distinct_values"] == ref["distinct"]
    assert record["nan_count"] == ref["nan_count"]
    for k in ("min", "max", "mean", "mean_abs", "rms", "zero_fraction"):
        assert record[k] == pytest.approx(ref[k], rel=1e-12, abs=1e-15), k


def chunks(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(x.flatten().tensor_split(n))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bit_pattern_stats_match_direct_computation(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(40, 77, generator=gen) * 3).to(dtype)  # < 4096 values: the table is kept
    x.view(-1)[:6] = torch.tensor([0.0, -0.0, float("nan"), float("nan"), 1.0, -1.0]).to(dtype)
    acc = BitPatternStats("BF16" if dtype == torch.bfloat16 else "F16")
    for c in chunks(x, 7):
        acc.update(c)
    record = acc.finish()
    check(record, reference(x))
    assert record["distinct_exact"]
    # -0 and +0 are one value; the two NaNs are one value
    values = [v for v, _ in record["values"] if v is not None]
    assert values == sorted(values) and values.count(0.0) == 1


def test_streaming_stats_exact_then_lower_bound() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5000, generator=gen)
    for exact in (StreamingStats("F32"), StreamingStats("F32", numel=5000)):  # moments + table, table only
        for c in chunks(x, 3):
            exact.update(c)
        record = exact.finish()
        check(record, reference(x))
        assert record["distinct_exact"] and record["distinct_values"] == 5000
    capped = StreamingStats("F32", distinct_cap=1000)
    for c in chunks(x, 5):
        capped.update(c)
    record = capped.finish()
    assert not record["distinct_exact"]
    assert 1000 < record["distinct_values"] <= 5000  # a lower bound, labelled as such
    ref = reference(x)
    for k in ("min", "max", "mean", "mean_abs", "rms"):
        assert record[k] == pytest.approx(ref[k], rel=1e-9), k


def test_mxfp4_stats_match_dequantized_tensor() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=gen) * torch.logspace(-3, 1, 96)[:, None]
    packed, scale = quantize_mxfp4(w)
    acc = MXFP4Stats()
    for r0 in range(0, 96, 40):  # uneven row chunks
        acc.update(packed[r0 : r0 + 40], scale[r0 : r0 + 40])
    record = acc.finish()
    dense = dequantize_mxfp4(packed, scale, torch.float64)
    check(record, reference(dense))
    assert sum(record["code_histogram"]) == dense.numel()
    assert sum(record["scale_histogram"]) == dense.numel() // 32


def test_value_table_histogram_counts_every_nonzero() -> None:
    values = torch.tensor([-4.0, -1e-30, 0.0, 0.5, 3.0, 1e30], dtype=torch.float64)
    counts = torch.tensor([1, 2, 3, 4, 5, 6])
    record = stats_from_value_table(values, counts)
    h = record["magnitude_histogram"]
    assert sum(h["counts"]) + h["under"] + h["over"] == 1 + 2 + 4 + 5 + 6
    assert h["under"] == 2 and h["over"] == 6
    assert record["zero_fraction"] == 3 / 21
    assert record["sign_balance"] == pytest.approx((15 - 3) / 18)


def test_all_zero_tensor() -> None:
    acc = BitPatternStats("BF16")
    acc.update(torch.zeros(70000, dtype=torch.bfloat16))
    record = acc.finish()
    assert record["distinct_values"] == 1 and record["zero_fraction"] == 1.0
    assert record["min"] == record["max"] == record["rms"] == 0.0


def test_cosine_similarities_match_direct_computation() -> None:
    gen = torch.Generator().manual_seed(4)
    mats = {e: torch.randn(37, 19, generator=gen) for e in range(6)}
    mats[5] = torch.zeros(37, 19)  # no direction: no cosine
    pairs, subset = expert_pairs(6, subset=4, sampled=3)
    assert all(a < b for a, b in pairs) and (0, 1) in pairs and (4, 5) in pairs
    got = cosine_similarities(
        list(mats), 37, 19, lambda e, a, b: mats[e][a:b], pairs, memory_budget=4 * 19 * 6 * 5
    )  # a budget of 5 rows: several chunks
    for a, b in pairs:
        if 5 in (a, b):
            assert got[(a, b)] is None
        else:
            want = torch.nn.functional.cosine_similarity(
                mats[a].flatten().double(), mats[b].flatten().double(), 0
            )
            assert got[(a, b)] == pytest.approx(float(want), abs=1e-6)


def test_mxfp4_stats_equal_the_codecs_value_counts() -> None:
    """The joint (scale, byte) histogram gives exactly `mxfp4_value_counts` of the whole matrix, NaN scales,
    both zeros and equal products of different (scale, code) pairs included."""
    from k3.ops.mxfp4 import mxfp4_value_counts

    gen = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (45, 48), dtype=torch.uint8, generator=gen)
    scale = torch.randint(120, 130, (45, 3), dtype=torch.uint8, generator=gen)
    scale[3, 1], scale[9, 0], scale[10, 2] = 255, 0, 254  # NaN block, smallest and largest scale
    acc = MXFP4Stats()
    for r0 in range(0, 45, 16):
        acc.update(packed[r0 : r0 + 16], scale[r0 : r0 + 16])
    record = acc.finish()
    want = mxfp4_value_counts(packed, scale)
    finite = ~want.values.isnan()
    assert record["values"][:-1] == [
        [v, c] for v, c in zip(want.values[finite].tolist(), want.counts[finite].tolist(), strict=True)
    ]
    assert record["values"][-1] == [None, 32] and record["nan_count"] == 32
    assert record["code_histogram"] == want.code_histogram.tolist()
    assert record["scale_histogram"] == want.scale_histogram.tolist()
    with pytest.raises(ValueError, match="not a pair"):
        acc.update(packed[:2], scale[:3])


@pytest.mark.parametrize(
    ("dtype", "name"), [(torch.int8, "I8"), (torch.uint8, "U8"), (torch.bool, "BOOL"), (torch.float16, "F16")]
)
def test_bit_pattern_stats_other_dtypes(dtype: torch.dtype, name: str) -> None:
    gen = torch.Generator().manual_seed(8)
    if dtype.is_floating_point:
        x = (torch.randn(300, 250, generator=gen) * 100).to(dtype)
    else:
        x = torch.randint(
            -128 if dtype == torch.int8 else 0, 2 if dtype == torch.bool else 128, (300, 250), generator=gen
        ).to(dtype)
    acc = BitPatternStats(name)
    for c in chunks(x, 4):
        acc.update(c)
    check(acc.finish(), reference(x))


@pytest.mark.skipif(not native_available(), reason="native kernels not built: python -m k3.ops.build")
def test_native_and_bincount_histograms_give_the_same_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native byte histograms (the scan's fast path) against torch.bincount, chunk by chunk."""
    gen = torch.Generator().manual_seed(3)
    every_pattern = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    chunks = [
        every_pattern,
        torch.randn(5000, generator=gen).to(torch.bfloat16),
        torch.zeros(7, dtype=torch.bfloat16),
    ]
    packed, scale = quantize_mxfp4(torch.randn(48, 256, generator=gen) * 3.0)
    scale[0, 0] = 0  # an all-zero-scale block and the NaN scale byte
    scale[1, 1] = 255

    def records() -> tuple[dict, dict]:
        bits = BitPatternStats("BF16")
        for chunk in chunks:
            bits.update(chunk)
        mx = MXFP4Stats()
        for r0 in range(0, 48, 20):
            mx.update(packed[r0 : r0 + 20], scale[r0 : r0 + 20])
        return bits.finish(), mx.finish()

    native = json.dumps(records())  # as text: the all-patterns record has NaN moments (NaN != NaN)
    monkeypatch.setattr("k3.atlas.stats.native_histograms", lambda: None)
    assert json.dumps(records()) == native
