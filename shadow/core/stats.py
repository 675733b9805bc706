"""One-sided tests that a canary cohort is worse than a control cohort: pure functions.

- `mann_whitney_greater(x, y)`: Mann-Whitney U, H1 "x tends to be larger than y" (latencies), by
  the normal approximation with tie and continuity corrections (valid from ~20 samples a side;
  equal to scipy.stats.mannwhitneyu(x, y, alternative="greater", method="asymptotic")).
- `fisher_greater(fx, nx, fy, ny)`: Fisher's exact test on the 2×2 table of failures, H1 "x fails
  more often than y" (equal to scipy.stats.fisher_exact(..., alternative="greater")).
Both return a p-value: small means the canary is worse beyond chance.
- `quantile(values, q)`: the one exact-sample quantile every report uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def _ranks(values: Sequence[float]) -> tuple[list[float], float]:
    """Mid-ranks (1-based) of `values` in their order, and Σ(t³ − t) over the groups of ties."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    ties = 0.0
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        mid = (i + j) / 2.0 + 1.0
        for k in range(i, j + 1):
            ranks[order[k]] = mid
        t = j - i + 1
        ties += t**3 - t
        i = j + 1
    return ranks, ties


def mann_whitney_greater(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(U of x, one-sided p-value that x is stochastically greater than y); p = 1 with an empty side
    or no spread at all."""
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return 0.0, 1.0
    ranks, ties = _ranks([*x, *y])
    u1 = sum(ranks[:n1]) - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    var = n1 * n2 / 12.0 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
    if var <= 0:
        return u1, 1.0
    z = (u1 - n1 * n2 / 2.0 - 0.5) / math.sqrt(var)
    return u1, 0.5 * math.erfc(z / math.sqrt(2.0))


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def fisher_greater(fx: int, nx: int, fy: int, ny: int) -> float:
    """One-sided p-value that cohort x (fx failures of nx) fails more often than y (fy of ny):
    P(X >= fx) for X hypergeometric with the table's margins."""
    if not (0 <= fx <= nx and 0 <= fy <= ny):
        raise ValueError(f"failures must be within their counts: {fx}/{nx}, {fy}/{ny}")
    failures, total = fx + fy, nx + ny
    if nx == 0 or ny == 0 or failures == 0:
        return 1.0
    hi = min(failures, nx)
    base = _log_comb(total, failures)
    terms = [_log_comb(nx, k) + _log_comb(ny, failures - k) - base for k in range(fx, hi + 1)]
    top = max(terms)
    p = math.exp(top) * sum(math.exp(t - top) for t in terms)
    return min(1.0, p)


def quantile(values: Sequence[float] | npt.NDArray[np.float64], q: float) -> float | None:
    """The `q` quantile (0–1) of exact samples, linear between order statistics (numpy's and R's
    default, type 7); None for no values. Every exact percentile the project reports is this one
    (histograms and sketches answer within their bins instead)."""
    if not len(values):
        return None
    return float(np.quantile(np.asarray(values, dtype=np.float64), q))
