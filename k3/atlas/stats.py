"""Per-tensor statistics, accumulated streaming over chunks so that no tensor is ever held whole.

Three accumulators, one per storage kind, all ending in the same record:

* `BitPatternStats` for 16-bit floats (BF16, F16) and 8-bit integers: a histogram of the raw bit patterns
  (65,536 or 256 bins). Every statistic follows exactly from it: the distinct values are the patterns in use
  (with -0 and +0 merged, and all NaN patterns counted as one value), and min, max, mean, RMS and the
  magnitude histogram are sums over the (value, count) table.
* `MXFP4Stats` for a `weight_packed` / `weight_scale` pair: the (value, count) table of
  `k3.ops.mxfp4.mxfp4_value_counts`, merged over row chunks, plus code and scale histograms. The matrix is
  never dequantized.
* `StreamingStats` for everything else (F32, F64, wide integers): running moments and a magnitude
  histogram, and the distinct values kept exactly in a running `torch.unique` table until it holds more than
  `DISTINCT_CAP` entries; past that the count is a lower bound and `distinct_exact` is false.

The record (`finish()`) is a plain dict ready for JSON; `STAT_KEYS` lists its scalar fields.
"""

from __future__ import annotations

import math
from typing import Any

import torch

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

# torch dtypes of the safetensors dtype strings the atlas reads as numbers
TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
BIT_PATTERN_DTYPES = ("BF16", "F16", "U8", "I8", "BOOL")


def _magnitude_histogram(magnitudes: torch.Tensor, counts: torch.Tensor | None = None) -> dict[str, Any]:
    """Histogram of nonzero finite-or-inf magnitudes (float64 [N]), each weighted by `counts` (or 1)."""
    weights = torch.ones_like(magnitudes, dtype=torch.int64) if counts is None else counts
    nonzero = magnitudes > 0
    mags, weights = magnitudes[nonzero], weights[nonzero]
    bins = torch.floor(torch.log2(mags) * HIST_PER_OCTAVE).to(torch.float64) - HIST_LOW_EXP * HIST_PER_OCTAVE
    under = bins < 0
    over = (bins >= HIST_BINS) | torch.isinf(mags)
    inside = ~(under | over)
    hist = torch.zeros(HIST_BINS, dtype=torch.int64)
    hist.scatter_add_(0, bins[inside].long(), weights[inside])
    return {"hist": hist, "under": int(weights[under].sum()), "over": int(weights[over].sum())}


def _histogram_record(hist: torch.Tensor, under: int, over: int) -> dict[str, Any]:
    """Compact JSON form: only the span of bins in use, with the log2 edge of the first."""
    used = torch.nonzero(hist).flatten()
    if used.numel() == 0:
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


def _abs_quantile(hist: torch.Tensor, under: int, over: int, q: float, abs_max: float) -> float:
    """Upper edge of the histogram bin holding the q-quantile of nonzero magnitudes (capped by abs_max)."""
    total = int(hist.sum()) + under + over
    if total == 0:
        return 0.0
    target = q * total - under
    if target <= 0:
        return min(abs_max, 2.0**HIST_LOW_EXP)
    cumulative = torch.cumsum(hist, 0)
    idx = int(torch.searchsorted(cumulative, torch.tensor(target, dtype=torch.int64).ceil().long()))
    if idx >= HIST_BINS:
        return abs_max
    return min(abs_max, 2.0 ** (HIST_LOW_EXP + (idx + 1) / HIST_PER_OCTAVE))


def stats_from_value_table(values: torch.Tensor, counts: torch.Tensor, nan_count: int = 0) -> dict[str, Any]:
    """Every statistic of a tensor whose distinct non-NaN values are `values` (float64 [V]) occurring
    `counts` (int64 [V]) times. Exact up to float64 rounding of the sums."""
    values = values.to(torch.float64)
    counts = counts.to(torch.int64)
    n = int(counts.sum())
    total = n + nan_count
    c = counts.to(torch.float64)
    record: dict[str, Any] = {"numel": total, "nan_count": nan_count}
    if n == 0:
        record.update(
            dict.fromkeys(("min", "max", "mean", "mean_abs", "rms", "std", "abs_max", "abs_p99"), None)
        )
        record.update(zero_fraction=0.0, positive_fraction=0.0, negative_fraction=0.0, sign_balance=0.0)
        record["magnitude_histogram"] = _histogram_record(torch.zeros(HIST_BINS, dtype=torch.int64), 0, 0)
        return record
    mean = float((values * c).sum()) / n
    mean_sq = float((values * values * c).sum()) / n
    zeros = int(counts[values == 0].sum())
    positive = int(counts[values > 0].sum())
    negative = int(counts[values < 0].sum())
    mags = values.abs()
    hist = _magnitude_histogram(mags, counts)
    abs_max = float(mags.max())
    record.update(
        min=float(values.min()),
        max=float(values.max()),
        mean=mean,
        mean_abs=float((mags * c).sum()) / n,
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


def _value_table_record(
    values: torch.Tensor, counts: torch.Tensor, nan_count: int
) -> list[list[float]] | None:
    if values.numel() + (nan_count > 0) > VALUE_TABLE_LIMIT:
        return None
    table = [[float(v), int(c)] for v, c in zip(values.tolist(), counts.tolist(), strict=True)]
    if nan_count:
        table.append([None, nan_count])  # JSON has no NaN: the NaN entry's value is null
    return table


class BitPatternStats:
    """Exact statistics of a 16-bit float or 8-bit integer tensor from its bit-pattern histogram."""

    def __init__(self, dtype: str):
        if dtype not in BIT_PATTERN_DTYPES:
            raise ValueError(f"BitPatternStats reads {BIT_PATTERN_DTYPES}, not {dtype}")
        self.dtype = dtype
        self.bits = 16 if dtype in ("BF16", "F16") else 8
        self.patterns = torch.zeros(1 << self.bits, dtype=torch.int64)  # [65536] or [256]

    def update(self, chunk: torch.Tensor) -> None:
        """`chunk`: any shape, of this accumulator's dtype."""
        if self.bits == 16:  # bincount takes no uint16; the widening copy is the one pass over the chunk
            keys = chunk.reshape(-1).view(torch.uint16).to(torch.int32)
        else:
            keys = chunk.reshape(-1).view(torch.uint8).to(torch.int32)
        self.patterns += torch.bincount(keys, minlength=1 << self.bits)

    def value_table(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(distinct non-NaN values float64 ascending, counts, NaN count)."""
        used = torch.nonzero(self.patterns).flatten()
        counts = self.patterns[used]
        if self.bits == 16:
            torch_dtype = TORCH_DTYPES[self.dtype]
            values = used.to(torch.int32).to(torch.int16).view(torch_dtype).to(torch.float64)
        else:
            values = used.to(torch.uint8).view(TORCH_DTYPES[self.dtype]).to(torch.float64)
        nan = values.isnan()
        nan_count = int(counts[nan].sum())
        values, counts = values[~nan], counts[~nan]
        values = values + 0.0  # -0.0 -> +0.0, so the two zeros merge below
        distinct, inverse = torch.unique(values, sorted=True, return_inverse=True)
        merged = torch.zeros(distinct.numel(), dtype=torch.int64).scatter_add_(0, inverse, counts)
        return distinct, merged, nan_count

    def finish(self) -> dict[str, Any]:
        values, counts, nan_count = self.value_table()
        record = stats_from_value_table(values, counts, nan_count)
        record["distinct_values"] = int(values.numel()) + (nan_count > 0)
        record["distinct_exact"] = True
        record["distinct_method"] = f"{self.bits}-bit pattern histogram"
        record["values"] = _value_table_record(values, counts, nan_count)
        return record


class MXFP4Stats:
    """Exact statistics of an MXFP4 matrix from its codes and scales, merged over row chunks."""

    def __init__(self) -> None:
        self.values = torch.zeros(0, dtype=torch.float64)
        self.counts = torch.zeros(0, dtype=torch.int64)
        self.nan_count = 0
        self.code_histogram = torch.zeros(16, dtype=torch.int64)
        self.scale_histogram = torch.zeros(256, dtype=torch.int64)

    def update(self, packed: torch.Tensor, scale: torch.Tensor) -> None:
        """`packed` uint8 [r, K/2] and `scale` uint8 [r, K/32]: the same rows of both tensors."""
        from k3.ops.mxfp4 import mxfp4_value_counts

        vc = mxfp4_value_counts(packed, scale)
        nan = vc.values.isnan()
        self.nan_count += int(vc.counts[nan].sum())
        values = torch.cat([self.values, vc.values[~nan]])
        counts = torch.cat([self.counts, vc.counts[~nan]])
        self.values, inverse = torch.unique(values, sorted=True, return_inverse=True)
        self.counts = torch.zeros(self.values.numel(), dtype=torch.int64).scatter_add_(0, inverse, counts)
        self.code_histogram += vc.code_histogram
        self.scale_histogram += vc.scale_histogram

    def finish(self) -> dict[str, Any]:
        record = stats_from_value_table(self.values, self.counts, self.nan_count)
        record["distinct_values"] = int(self.values.numel()) + (self.nan_count > 0)
        record["distinct_exact"] = True
        record["distinct_method"] = "MXFP4 codes x scales"
        record["values"] = _value_table_record(self.values, self.counts, self.nan_count)
        record["code_histogram"] = self.code_histogram.tolist()
        record["scale_histogram"] = self.scale_histogram.tolist()
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
        self.hist = torch.zeros(HIST_BINS, dtype=torch.int64)
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
        h = _magnitude_histogram(a.to(torch.float64))
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
            values, counts = self.distinct
            record = stats_from_value_table(values, counts, self.nan_count)
            record["distinct_values"] = int(values.numel()) + (self.nan_count > 0)
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


SMALL_TENSOR = 1 << 16  # elements; below this a running unique is cheaper than a 65,536-bin histogram


def accumulator_for(dtype: str, numel: int) -> BitPatternStats | StreamingStats:
    """The accumulator for a dense tensor of a safetensors dtype (MXFP4 pairs use `MXFP4Stats`).

    Small tensors take the running-unique path, exact too (they have fewer elements than its cap)."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"the atlas cannot read tensors of dtype {dtype}")
    if dtype in BIT_PATTERN_DTYPES and numel >= SMALL_TENSOR:
        return BitPatternStats(dtype)
    return StreamingStats(dtype, numel=numel)
