"""Per-request samples (TTFT, TPOT, waits, decision times) kept exactly or in bounded memory.

Offline runs keep every sample (`list`, exact percentiles). Live lanes run for days, so they keep
a `LogHistogram`: log-spaced buckets of 1% relative width between 1 µs and 1 day, a fixed-size
array whatever the number of samples; percentiles are exact to within one bucket (1%).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from shadow.core.stats import quantile


class SampleSink(Protocol):
    """Anything samples can be appended to (a list, a LogHistogram)."""

    def append(self, value: float, /) -> None: ...

    def __len__(self) -> int: ...


class LogHistogram:
    """Bounded-memory sample summary; see module docstring."""

    __slots__ = ("_counts", "_log_lo", "_step", "count", "total", "zeros")

    LO = 1e-6
    HI = 86_400.0
    REL = 0.01

    def __init__(self) -> None:
        self._step = math.log1p(self.REL)
        self._log_lo = math.log(self.LO)
        n = math.ceil((math.log(self.HI) - self._log_lo) / self._step) + 1
        self._counts = np.zeros(n, dtype=np.int64)
        self.count = 0
        self.total = 0.0
        self.zeros = 0  # samples <= LO (counted at 0)

    def append(self, value: float, /) -> None:
        if not math.isfinite(value):
            return
        self.count += 1
        self.total += value
        if value <= self.LO:
            self.zeros += 1
            return
        i = int((math.log(value) - self._log_lo) / self._step)
        self._counts[min(i, len(self._counts) - 1)] += 1

    def __len__(self) -> int:
        return self.count

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def cumulative(self, bounds: tuple[float, ...]) -> list[int]:
        """Samples <= each bound (within one bucket), for Prometheus histogram buckets."""
        cum = np.cumsum(self._counts)
        out: list[int] = []
        for b in bounds:
            if b <= self.LO:
                out.append(self.zeros)
                continue
            i = int((math.log(b) - self._log_lo) / self._step)
            out.append(self.zeros + int(cum[min(i, len(cum) - 1)]))
        return out

    def percentile(self, q: float) -> float | None:
        """The q-th percentile (0–100), to within 1%; None without samples."""
        if not self.count:
            return None
        rank = q / 100.0 * (self.count - 1)
        if rank < self.zeros:
            return 0.0
        cum = np.cumsum(self._counts)
        i = int(np.searchsorted(cum, rank - self.zeros, side="right"))
        i = min(i, len(self._counts) - 1)
        # bucket midpoint (geometric)
        return math.exp(self._log_lo + (i + 0.5) * self._step)


def percentile(values: SampleSink | Sequence[float], q: float, scale: float = 1.0) -> float | None:
    """q-th percentile of a list (exact: `core.stats.quantile`) or a LogHistogram (within 1%),
    times `scale`; None without samples."""
    p = values.percentile(q) if isinstance(values, LogHistogram) else quantile(values, q / 100.0)  # type: ignore[arg-type]
    return None if p is None else p * scale
