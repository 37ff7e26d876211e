"""Per-tensor statistics, accumulated streaming over chunks so that no tensor is ever held whole.

Three accumulators, one per storage kind, all ending in the same record:

* `BitPatternStats` for 16-bit floats (BF16, F16) and 8-bit integers: a histogram of the raw bit patterns
  (65,536 or 256 bins). Every statistic follows exactly from it: the distinct values are the patterns in use
  (with -0 and +0 merged, and all NaN patterns counted as one value), and min, max, mean, RMS and the
  magnitude histogram are sums over the (value, count) table.
* `MXFP4Stats` for a `weight_packed` / `weight_scale` pair: a joint histogram of (scale byte, packed byte)
  (65,536 bins), from which the (value, count) table of `k3.ops.mxfp4.mxfp4_value_counts`, the code and the
  scale histograms follow exactly. The matrix is never dequantized.
* `StreamingStats` for everything else (F32, F64, wide integers): running moments and a magnitude
  histogram, and the distinct values kept exactly in a running `torch.unique` table until it holds more than
  `DISTINCT_CAP` entries; past that the count is a lower bound and `distinct_exact` is false.

The record (`finish()`) is a plain dict ready for JSON; `STAT_KEYS` lists its scalar fields. The
per-tensor work after the pass (value tables of at most 65,536 entries) is numpy, whose per-call cost is a
fraction of torch's: on checkpoints of many small matrices that fixed cost is what the scan spends.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from k3.checkpoint import TORCH_DTYPES as CHECKPOINT_DTYPES
from k3.ops.mxfp4.stats import add_scaled_byte_histogram

# Magnitude histogram: bins of a quarter octave over |w| in [2^-40, 2^24); zeros are counted apart, smaller
# nonzero magnitudes go to `under`, larger ones (and inf) to `over`.
HIST_PER_OCTAVE = 4
HIST_LOW_EXP = -40
HIST_HIGH_EXP = 24
HIST_BINS = (HIST_HIGH_EXP - HIST_LOW_EXP) * HIST_PER_OCTAVE

DISTINCT_CAP = 1 << 20  # distinct values tracked exactly by StreamingStats before giving up
VALUE_TABLE_LIMIT = 4096  # a record keeps its (value, count) table when it has at most this many entries

STAT_KEYS = (
    "min",
    "max",
    "mean",
    "mean_abs",
    "rms",
    "std",
    "abs_max",
    "abs_p99",
    "zero_fraction",
    "positive_fraction",
    "negative_fraction",
    "sign_balance",
    "nan_count",
    "distinct_values",
)

# torch dtypes of the safetensors dtype strings the atlas reads as numbers (the FP8 types have no
# arithmetic on CPU to speak of)
TORCH_DTYPES = {name: dtype for name, dtype in CHECKPOINT_DTYPES.items() if not name.startswith("F8")}
BIT_PATTERN_DTYPES = ("BF16", "F16", "U8", "I8", "BOOL")


def _magnitude_histogram(magnitudes: np.ndarray, counts: np.ndarray | None = None) -> dict[str, Any]:
    """Histogram of nonzero finite-or-inf magnitudes (float64 [N]), each weighted by `counts` (or 1)."""
    nonzero = magnitudes > 0
    mags = magnitudes[nonzero]
    weights = np.ones(mags.size, dtype=np.int64) if counts is None else counts[nonzero]
    with np.errstate(over="ignore"):  # inf magnitudes go to `over`
        bins = np.floor(np.log2(mags) * HIST_PER_OCTAVE) - HIST_LOW_EXP * HIST_PER_OCTAVE
    under = bins < 0
    over = (bins >= HIST_BINS) | np.isinf(mags)
    inside = ~(under | over)
    hist = np.bincount(bins[inside].astype(np.int64), weights=weights[inside], minlength=HIST_BINS)
    # float64 weights sum exactly below 2^53 elements per bin
    return {
        "hist": hist.astype(np.int64),
        "under": int(weights[under].sum()),
        "over": int(weights[over].sum()),
    }


def _histogram_record(hist: np.ndarray, under: int, over: int) -> dict[str, Any]:
    """Compact JSON form: only the span of bins in use, with the log2 edge of the first."""
    used = np.flatnonzero(hist)
    if used.size == 0:
        first, counts = 0, []
    else:
        first, last = int(used[0]), int(used[-1])
        counts = hist[first : last + 1].tolist()
    return {
        "per_octave": HIST_PER_OCTAVE,
        "first_log2": HIST_LOW_EXP + first / HIST_PER_OCTAVE,  # bin i covers [2^(first_log2+i/p), ...)
        "counts": counts,
        "under": under,
        "over": over,
    }


def _abs_quantile(hist: np.ndarray, under: int, over: int, q: float, abs_max: float) -> float:
    """Upper edge of the histogram bin holding the q-quantile of nonzero magnitudes (capped by abs_max)."""
    total = int(hist.sum()) + under + over
    if total == 0:
        return 0.0
    target = q * total - under
    if target <= 0:
        return min(abs_max, 2.0**HIST_LOW_EXP)
    idx = int(np.searchsorted(np.cumsum(hist), math.ceil(target)))
    if idx >= HIST_BINS:
        return abs_max
    return min(abs_max, 2.0 ** (HIST_LOW_EXP + (idx + 1) / HIST_PER_OCTAVE))


def stats_from_value_table(
    values: torch.Tensor | np.ndarray, counts: torch.Tensor | np.ndarray, nan_count: int = 0
) -> dict[str, Any]:
    """Every statistic of a tensor whose distinct non-NaN values are `values` (float64 [V]) occurring
    `counts` (int64 [V]) times. Exact up to float64 rounding of the sums.

    Computed in numpy: the tables are small (at most 65,536 entries), where numpy's per-call cost is a
    fraction of torch's, and a scan makes this call once per tensor."""
    values = np.asarray(values, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    total = n + nan_count
    record: dict[str, Any] = {"numel": total, "nan_count": nan_count}
    if n == 0:
        record.update(
            dict.fromkeys(("min", "max", "mean", "mean_abs", "rms", "std", "abs_max", "abs_p99"), None)
        )
        record.update(zero_fraction=0.0, positive_fraction=0.0, negative_fraction=0.0, sign_balance=0.0)
        record["magnitude_histogram"] = _histogram_record(np.zeros(HIST_BINS, dtype=np.int64), 0, 0)
        return record
    c = counts.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # infinite values give infinite (or NaN) moments
        mean = float(np.dot(values, c)) / n
        mean_sq = float(np.dot(values * values, c)) / n
    mags = np.abs(values)
    zeros = int(counts[values == 0].sum())
    positive = int(counts[values > 0].sum())
    negative = int(counts[values < 0].sum())
    hist = _magnitude_histogram(mags, counts)
    abs_max = float(mags.max())
    record.update(
        min=float(values.min()),
        max=float(values.max()),
        mean=mean,
        mean_abs=float(np.dot(mags, c)) / n,
        rms=math.sqrt(mean_sq),
        std=math.sqrt(max(mean_sq - mean * mean, 0.0)),
        abs_max=abs_max,
        abs_p99=_abs_quantile(hist["hist"], hist["under"], hist["over"], 0.99, abs_max),
        zero_fraction=zeros / total,
        positive_fraction=positive / total,
        negative_fraction=negative / total,
        sign_balance=(positive - negative) / max(positive + negative, 1),
        magnitude_histogram=_histogram_record(hist["hist"], hist["under"], hist["over"]),
    )
    return record


def _value_table_record(values: np.ndarray, counts: np.ndarray, nan_count: int) -> list[list[Any]] | None:
    if values.size + (nan_count > 0) > VALUE_TABLE_LIMIT:
        return None
    table: list[list[Any]] = list(map(list, zip(values.tolist(), counts.tolist(), strict=True)))
    if nan_count:
        table.append([None, nan_count])  # JSON has no NaN: the NaN entry's value is null
    return table


def _merge_equal_values(values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(distinct non-NaN values ascending, their summed counts, NaN count) of a (value, count) table whose
    values may repeat; -0.0 and +0.0 are one value."""
    nan = np.isnan(values)
    nan_count = int(counts[nan].sum())
    distinct, inverse = np.unique(values[~nan] + 0.0, return_inverse=True)  # "+ 0.0": -0.0 -> +0.0
    merged = np.zeros(distinct.size, dtype=np.int64)
    np.add.at(merged, inverse.reshape(-1), counts[~nan])
    return distinct, merged, nan_count


def native_histograms() -> Any:
    """The native kernel module with `histogram_u16` / `histogram_scaled_bytes` (built by `make native`), or
    None: the accumulators then count with `torch.bincount`, ~3x slower, with the same results."""
    from k3.ops.mxfp4.native import load_native

    return load_native()


class BitPatternStats:
    """Exact statistics of a 16-bit float or 8-bit integer tensor from its bit-pattern histogram.

    `update` is the only pass over the data: one native histogram per chunk, or without the native module
    one `torch.bincount` (16-bit patterns are first widened to int32 in a scratch buffer reused over
    chunks, since bincount takes no uint16)."""

    def __init__(self, dtype: str):
        if dtype not in BIT_PATTERN_DTYPES:
            raise ValueError(f"BitPatternStats reads {BIT_PATTERN_DTYPES}, not {dtype}")
        self.dtype = dtype
        self.bits = 16 if dtype in ("BF16", "F16") else 8
        self.patterns = torch.zeros(1 << self.bits, dtype=torch.int64)  # [65536] or [256]
        self._keys = torch.empty(0, dtype=torch.int32)  # scratch: the widened patterns of one chunk
        self._native = native_histograms() if self.bits == 16 else None

    def update(self, chunk: torch.Tensor) -> None:
        """`chunk`: any shape, of this accumulator's dtype."""
        flat = chunk.reshape(-1)
        if self.bits == 8:
            self.patterns += torch.bincount(flat.view(torch.uint8), minlength=256)
            return
        if self._native is not None:
            self._native.histogram_u16(flat.contiguous(), self.patterns)
            return
        if self._keys.numel() < flat.numel():
            self._keys = torch.empty(flat.numel(), dtype=torch.int32)
        keys = self._keys[: flat.numel()]
        keys.copy_(flat.view(torch.int16))  # sign-extends: patterns >= 0x8000 come out negative ...
        keys.bitwise_and_(0xFFFF)  # ... and this takes the sign extension off again
        self.patterns += torch.bincount(keys, minlength=1 << 16)

    def value_table(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(distinct non-NaN values float64 ascending, counts int64, NaN count)."""
        patterns = self.patterns.numpy()
        used = np.flatnonzero(patterns)  # the bit patterns in use, ascending
        if self.dtype == "BF16":  # a BF16 pattern is the high half of the float32 with the same value
            values = (used.astype(np.uint32) << 16).view(np.float32)
        elif self.dtype == "F16":
            values = used.astype(np.uint16).view(np.float16)
        elif self.dtype == "I8":
            values = used.astype(np.uint8).view(np.int8)
        elif self.dtype == "BOOL":
            values = used != 0
        else:  # U8
            values = used
        with np.errstate(invalid="ignore"):  # signalling-NaN patterns widen to NaN (counted as NaN)
            wide = values.astype(np.float64)
        return _merge_equal_values(wide, patterns[used])

    def finish(self) -> dict[str, Any]:
        values, counts, nan_count = self.value_table()
        record = stats_from_value_table(values, counts, nan_count)
        record["distinct_values"] = int(values.size) + (nan_count > 0)
        record["distinct_exact"] = True
        record["distinct_method"] = f"{self.bits}-bit pattern histogram"
        record["values"] = _value_table_record(values, counts, nan_count)
        return record


@functools.cache
def _mxfp4_pair_values() -> np.ndarray:
    """float64 [256, 16]: the value of E2M1 code c under E8M0 scale byte s (row 255 is NaN); exact."""
    from k3.ops.mxfp4.codec import e2m1_table, e8m0_table

    return (e8m0_table(torch.float64)[:, None] * e2m1_table(torch.float64)[None, :]).numpy()


class MXFP4Stats:
    """Exact statistics of an MXFP4 matrix from its codes and scales, merged over row chunks.

    The one pass over the data is a joint histogram of (scale byte, packed byte) over every byte of every
    block (65,536 bins; `k3.ops.mxfp4.stats.add_scaled_byte_histogram`, shared with the codec's stats):
    each packed byte holds two codes under its block's scale, so the (scale, code) pair counts, the value
    table (products merged where equal, as `k3.ops.mxfp4.mxfp4_value_counts` does), the code histogram
    and the scale histogram all follow from it exactly. The matrix is never dequantized."""

    def __init__(self) -> None:
        self.joint = torch.zeros(256 * 256, dtype=torch.int64)  # [scale byte * 256 + packed byte]
        self._native = native_histograms()

    def update(self, packed: torch.Tensor, scale: torch.Tensor) -> None:
        """`packed` uint8 [r, K/2] and `scale` uint8 [r, K/32]: the same rows of both tensors."""
        if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
            raise ValueError(f"MXFP4 parts must be uint8, got {packed.dtype} and {scale.dtype}")
        if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] != 16 * scale.shape[-1]:
            raise ValueError(f"packed {tuple(packed.shape)} and scale {tuple(scale.shape)} are not a pair")
        add_scaled_byte_histogram(self.joint, packed, scale, self._native)

    def finish(self) -> dict[str, Any]:
        scale_histogram = self.joint.numpy().reshape(256, 256).sum(axis=1) // 16  # blocks per scale byte
        scales = np.flatnonzero(scale_histogram)  # [S] scale bytes in use (a few, typically)
        joint = self.joint.numpy().reshape(256, 16, 16)[scales]  # [S, high nibble, low nibble]
        pair_counts = joint.sum(axis=1) + joint.sum(axis=2)  # [S, 16]: low-nibble + high-nibble codes
        in_use = pair_counts > 0
        values, counts, nan_count = _merge_equal_values(
            _mxfp4_pair_values()[scales][in_use], pair_counts[in_use]
        )
        record = stats_from_value_table(values, counts, nan_count)
        record["distinct_values"] = int(values.size) + (nan_count > 0)
        record["distinct_exact"] = True
        record["distinct_method"] = "MXFP4 codes x scales"
        record["values"] = _value_table_record(values, counts, nan_count)
        record["code_histogram"] = pair_counts.sum(axis=0).tolist()
        record["scale_histogram"] = scale_histogram.tolist()
        return record


class StreamingStats:
    """Running moments, magnitude histogram and a capped exact distinct-value table, for any dtype.

    Given `numel` <= the cap, the table can never overflow, so only the table is kept (everything follows
    from it); otherwise the moments run alongside, for when it does."""

    def __init__(self, dtype: str, distinct_cap: int = DISTINCT_CAP, numel: int | None = None):
        self.dtype = dtype
        self.distinct_cap = distinct_cap
        self.table_only = numel is not None and numel <= distinct_cap
        self.n = 0
        self.nan_count = 0
        self.sum = self.sum_abs = self.sum_sq = 0.0
        self.min, self.max = math.inf, -math.inf
        self.zeros = self.positive = self.negative = 0
        self.hist = np.zeros(HIST_BINS, dtype=np.int64)
        self.under = self.over = 0
        self.distinct: tuple[torch.Tensor, torch.Tensor] | None = (
            torch.zeros(0, dtype=torch.float64),
            torch.zeros(0, dtype=torch.int64),
        )
        self.distinct_lower_bound = 0

    def update(self, chunk: torch.Tensor) -> None:
        x = chunk.reshape(-1)
        x = x.to(torch.float64) if x.dtype in (torch.float64, torch.int64, torch.uint64, torch.uint32) else x
        x = x.to(torch.float32) if not x.is_floating_point() else x
        nan = x.isnan()
        n_nan = int(nan.sum())
        if n_nan:
            self.nan_count += n_nan
            x = x[~nan]
        if x.numel() == 0:
            return
        if self.table_only:
            self._update_distinct(x)
            return
        self.n += x.numel()
        self.sum += float(x.sum(dtype=torch.float64))
        a = x.abs()
        self.sum_abs += float(a.sum(dtype=torch.float64))
        self.sum_sq += float((a.to(torch.float64) ** 2).sum())
        self.min = min(self.min, float(x.min()))
        self.max = max(self.max, float(x.max()))
        self.zeros += int((x == 0).sum())
        self.positive += int((x > 0).sum())
        self.negative += int((x < 0).sum())
        h = _magnitude_histogram(a.to(torch.float64).numpy())
        self.hist += h["hist"]
        self.under += h["under"]
        self.over += h["over"]
        self._update_distinct(x)

    def _update_distinct(self, x: torch.Tensor) -> None:
        if self.distinct is None:
            return
        # "+ 0.0" merges -0.0 into +0.0; unique of the chunk first keeps the merge small
        chunk_values, chunk_counts = torch.unique(x.to(torch.float64) + 0.0, return_counts=True)
        values, inverse = torch.unique(torch.cat([self.distinct[0], chunk_values]), return_inverse=True)
        counts = torch.zeros(values.numel(), dtype=torch.int64).scatter_add_(
            0, inverse, torch.cat([self.distinct[1], chunk_counts])
        )
        if values.numel() > self.distinct_cap:
            self.distinct = None
            self.distinct_lower_bound = int(values.numel())
        else:
            self.distinct = (values, counts)

    def finish(self) -> dict[str, Any]:
        if self.distinct is not None:
            values, counts = self.distinct[0].numpy(), self.distinct[1].numpy()
            record = stats_from_value_table(values, counts, self.nan_count)
            record["distinct_values"] = int(values.size) + (self.nan_count > 0)
            record["distinct_exact"] = True
            record["distinct_method"] = "exact (running unique)"
            record["values"] = _value_table_record(values, counts, self.nan_count)
            return record
        n, total = self.n, self.n + self.nan_count
        mean, mean_sq = self.sum / n, self.sum_sq / n
        abs_max = max(abs(self.min), abs(self.max))
        return {
            "numel": total,
            "nan_count": self.nan_count,
            "min": self.min,
            "max": self.max,
            "mean": mean,
            "mean_abs": self.sum_abs / n,
            "rms": math.sqrt(mean_sq),
            "std": math.sqrt(max(mean_sq - mean * mean, 0.0)),
            "abs_max": abs_max,
            "abs_p99": _abs_quantile(self.hist, self.under, self.over, 0.99, abs_max),
            "zero_fraction": self.zeros / total,
            "positive_fraction": self.positive / total,
            "negative_fraction": self.negative / total,
            "sign_balance": (self.positive - self.negative) / max(self.positive + self.negative, 1),
            "magnitude_histogram": _histogram_record(self.hist, self.under, self.over),
            "distinct_values": self.distinct_lower_bound,
            "distinct_exact": False,
            "distinct_method": f"lower bound: more than {self.distinct_cap:,} distinct values",
            "values": None,
        }


SMALL_TENSOR = 1 << 12  # elements; below this a running unique is cheaper than a 65,536-bin histogram


def accumulator_for(dtype: str, numel: int) -> BitPatternStats | StreamingStats:
    """The accumulator for a dense tensor of a safetensors dtype (MXFP4 pairs use `MXFP4Stats`).

    Small tensors take the running-unique path, exact too (they have fewer elements than its cap)."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"the atlas cannot read tensors of dtype {dtype}")
    if dtype in BIT_PATTERN_DTYPES and numel >= SMALL_TENSOR:
        return BitPatternStats(dtype)
    return StreamingStats(dtype, numel=numel)
