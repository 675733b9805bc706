"""Confidence intervals every report uses: one Student t quantile, one interval for a mean, one for a
ratio. Pure functions.

- `t975(df)`: the 0.975 quantile of Student's t (two-sided 95 %), exact to 6 decimals for df ≤ 30
  and by the Cornish–Fisher expansion beyond (error < 1e-7 there), so an interval over 16 or 1,000
  samples is as wide as it should be (no fall-back to the normal's 1.96).
- `mean_interval(xs)`: the arithmetic mean and the half-width of its 95 % t-interval — for a figure
  that is itself a mean (tokens of spread per step, a latency).
- `ratio_interval(ratios)`: the geometric mean of positive ratios with the 95 % t-interval of the
  mean of their logarithms, mapped back: `exp(m ± t·s/√n)`. Both bounds are positive for any
  input, the interval is symmetric in "×" (a lane 2× better and 2× worse are equally far from 1),
  and the estimate of "A over B" is exactly the reciprocal of "B over A". Ratios that are not
  positive and finite cannot be on that scale; they are left out and counted (`skipped`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Fewer samples than this: a ratio is given without an interval (t with one degree of freedom is
#: 12.7 s/√n wide; two samples tell nothing about their spread).
MIN_SAMPLES = 3

_T975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157,
         2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922,
         2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831,
         2.048407, 2.045230, 2.042272)
_Z975 = 1.959963984540054
# Cornish–Fisher terms of t's quantile in powers of 1/df (Abramowitz & Stegun 26.7.5) at z = z_0.975
_CF = (
    (_Z975**3 + _Z975) / 4,
    (5 * _Z975**5 + 16 * _Z975**3 + 3 * _Z975) / 96,
    (3 * _Z975**7 + 19 * _Z975**5 + 17 * _Z975**3 - 15 * _Z975) / 384,
    (79 * _Z975**9 + 776 * _Z975**7 + 1482 * _Z975**5 - 1920 * _Z975**3 - 945 * _Z975) / 92160,
)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` ≥ 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    return _Z975 + math.fsum(c / float(df) ** (i + 1) for i, c in enumerate(_CF))


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean of `values` (at least one) and the half-width of its two-sided 95 % t-interval (0 for
    one value)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval needs at least one value")
    mean = math.fsum(values) / n
    if n < 2:
        return mean, 0.0
    var = math.fsum((x - mean) ** 2 for x in values) / (n - 1)
    return mean, t975(n - 1) * math.sqrt(var / n)


@dataclass(frozen=True, slots=True)
class RatioInterval:
    """A geometric-mean ratio over `n` samples with its 95 % interval (`low`/`high` None below
    MIN_SAMPLES; `ratio` None with no sample), and the samples left out (`skipped`)."""

    ratio: float | None
    low: float | None
    high: float | None
    n: int
    skipped: int = 0

    @property
    def verdict(self) -> str:
        """better / worse (the interval excludes 1 on that side) / no significant difference / too
        few samples (no interval)."""
        if self.low is None or self.high is None:
            return "too few windows"
        if self.low > 1.0:
            return "better"
        if self.high < 1.0:
            return "worse"
        return "no significant difference"

    def inverted(self) -> RatioInterval:
        """The same estimate read the other way round (B over A)."""
        return RatioInterval(
            None if self.ratio is None else 1.0 / self.ratio,
            None if self.high is None else 1.0 / self.high,
            None if self.low is None else 1.0 / self.low,
            self.n,
            self.skipped,
        )


def ratio_interval(ratios: Iterable[float], skipped: int = 0) -> RatioInterval:
    """Geometric mean of the positive, finite `ratios` with its 95 % t-interval on the log scale
    (see module docstring); the others are counted in `skipped` with the `skipped` given."""
    logs: list[float] = []
    for r in ratios:
        if r > 0 and math.isfinite(r):
            logs.append(math.log(r))
        else:
            skipped += 1
    n = len(logs)
    if n == 0:
        return RatioInterval(None, None, None, 0, skipped)
    m, half = mean_interval(logs)
    if n < MIN_SAMPLES:
        return RatioInterval(math.exp(m), None, None, n, skipped)
    return RatioInterval(math.exp(m), math.exp(m - half), math.exp(m + half), n, skipped)
