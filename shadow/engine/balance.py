"""Balance in the field's units, per lane, from its steps' per-worker KV loads L_g.

Per step (G workers, max L = max_g L_g, mean L = Σ L_g / G):
- balance ratio r = mean L / max L (NVIDIA's TRT-LLM ADP blog: avg/max tokens per rank per
  iteration); its step-time-weighted mean and p10 (time-weighted: the share of time spent below);
- idle rate = mean_g (1 − L_g / max L) = 1 − r (BF-IO's worker idle rate);
- max/min = max L / min L at p50/p90/p95 over steps (SGLang PR #25235's per-iteration form;
  infinite when a worker holds nothing, which `zero_min_fraction` counts).
Identity: 1 − r = (G·max L − Σ L_g) / (G·max L) = I(k) / (G·max L), shadow's I(k) in their units.
Speed-of-light throughput (NVIDIA: sol_time = Σ_k t_k·r_k, sol_tps = elapsed / sol_time × tps) with
elapsed = Σ_k t_k is throughput / (time-weighted mean r). Steps with max L = 0 hold no tokens and
are left out. Bounded memory and a few float operations per step: r and min/max (the inverse of
max/min) in 1/1000 bins, so max/min is exact to 0.1 % near 1 and coarser far from it (at 100: ±10 %);
below min/max = 0.001 (max/min > 1000, a worker holding nothing included) it counts as infinite.
"""

from __future__ import annotations

from shadow.contracts.report import BalanceFigures

_BINS = 1000


class BalanceTally:
    """Running sums and histograms over steps; `add` per step, `figures` at any time."""

    __slots__ = ("_mm", "_r_time", "steps", "sum_t", "sum_tr", "zero_min")

    def __init__(self) -> None:
        self._r_time = [0.0] * (_BINS + 1)  # step time per balance-ratio bin
        self._mm = [0] * (_BINS + 1)  # steps per min/max bin (bin 0: max/min > 1000 or infinite)
        self.steps = 0
        self.sum_t = 0.0
        self.sum_tr = 0.0
        self.zero_min = 0

    def add(self, mx: float, mn: float, total: float, workers: int, t_step: float) -> None:
        """One step: the largest and smallest load, their sum over `workers`, its duration."""
        if mx <= 0:
            return
        r = total / (workers * mx)
        self.steps += 1
        self.sum_t += t_step
        self.sum_tr += t_step * r
        self._r_time[min(int(r * _BINS), _BINS)] += t_step
        self._mm[min(int(mn / mx * _BINS), _BINS)] += 1
        if mn <= 0:
            self.zero_min += 1

    def ratio_mean(self) -> float | None:
        """The step-time-weighted mean balance ratio (None before any step with load)."""
        return self.sum_tr / self.sum_t if self.sum_t > 0 else None

    def ratio_quantile(self, q: float) -> float | None:
        """The balance ratio below which a share `q` of the time was spent (bin's lower edge)."""
        if self.sum_t <= 0:
            return None
        target, acc = q * self.sum_t, 0.0
        for i, t in enumerate(self._r_time):
            acc += t
            if acc >= target and t > 0:
                return i / _BINS
        return 1.0

    def max_min_quantile(self, q: float) -> float | None:
        """max/min at quantile `q` over the steps: from the min/max bins, highest first (the upper
        edge of max/min's bin; None when it is beyond 1000 or infinite, or before any step)."""
        if not self.steps:
            return None
        target, acc = q * self.steps, 0
        for i in range(_BINS, -1, -1):
            n = self._mm[i]
            acc += n
            if acc >= target and n > 0:
                return _BINS / i if i else None
        return None

    def figures(self, throughput_tokens_per_s: float | None) -> BalanceFigures:
        """The balance figures, with speed-of-light throughput from the lane's throughput."""
        r = self.ratio_mean()
        return {
            "balance_ratio_mean": r,
            "balance_ratio_p10": self.ratio_quantile(0.10),
            "idle_rate": None if r is None else 1.0 - r,
            "sol_throughput_tokens_per_s": throughput_tokens_per_s / r
            if r and throughput_tokens_per_s is not None
            else None,
            "max_min_ratio_p50": self.max_min_quantile(0.50),
            "max_min_ratio_p90": self.max_min_quantile(0.90),
            "max_min_ratio_p95": self.max_min_quantile(0.95),
            "zero_min_fraction": self.zero_min / self.steps if self.steps else None,
        }


#: The balance figures' names, in `BalanceTally.figures` order.
BALANCE_FIGURES: tuple[str, ...] = tuple(BalanceTally().figures(None))
