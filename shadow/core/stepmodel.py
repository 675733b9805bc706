"""Decode step-time model T = a·max_g L_g + b, and its online least-squares fit.

`StepTimeModel` is the model with fixed coefficients (used by the engine and the simulated
fleet); `StepTimeFit` accumulates (max load, measured step time) pairs and fits (a, b) with
their R², so that dashboards can say when KV tokens do not drive step time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Defaults: ≈ 60 ms per step at the paper-like load (G=8, B=64, ≈ 5.2 k KV tokens per request,
# max load ≈ 333 k tokens): 0.020 s + 1.2e-7 s/token × 333 k ≈ 0.060 s.
DEFAULT_A_S_PER_TOKEN = 1.2e-7
DEFAULT_B_S = 0.020


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """T(k) = a·max_g L_g(k) + b, in seconds; per-worker compute τ_g = a·L_g + b."""

    a: float = DEFAULT_A_S_PER_TOKEN
    b: float = DEFAULT_B_S

    def __post_init__(self) -> None:
        if not (math.isfinite(self.a) and self.a >= 0):
            raise ValueError(f"step model: a must be a finite number >= 0, got {self.a!r}")
        if not (math.isfinite(self.b) and self.b >= 0):
            raise ValueError(f"step model: b must be a finite number >= 0, got {self.b!r}")
        if self.a == 0 and self.b == 0:
            raise ValueError("step model: a and b cannot both be 0 (steps would take no time)")

    def step_time(self, max_load: float) -> float:
        """Barrier step time for a step whose heaviest worker holds `max_load` KV tokens."""
        return self.a * max_load + self.b

    def worker_time(self, load: float) -> float:
        """Compute time of one worker holding `load` KV tokens (before the barrier)."""
        return self.a * load + self.b


@dataclass(slots=True)
class StepTimeFit:
    """Online ordinary least squares of step time on max load, from sufficient statistics."""

    n: int = 0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0

    def add(self, max_load: float, step_time_s: float) -> None:
        """Record one measured step (ignores non-finite or negative samples)."""
        if not (math.isfinite(max_load) and math.isfinite(step_time_s)):
            return
        if max_load < 0 or step_time_s < 0:
            return
        self.n += 1
        self.sx += max_load
        self.sy += step_time_s
        self.sxx += max_load * max_load
        self.sxy += max_load * step_time_s
        self.syy += step_time_s * step_time_s

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) of the least-squares line, or None with fewer than 2 distinct loads."""
        if self.n < 2:
            return None
        var_x = self.sxx - self.sx * self.sx / self.n
        if var_x <= 1e-12 * max(1.0, self.sxx):
            return None
        a = (self.sxy - self.sx * self.sy / self.n) / var_x
        b = (self.sy - a * self.sx) / self.n
        return a, b

    def r_squared(self) -> float | None:
        """Coefficient of determination of the fit (None when undefined)."""
        coef = self.coefficients()
        if coef is None:
            return None
        var_y = self.syy - self.sy * self.sy / self.n
        if var_y <= 0:
            return None
        cov = self.sxy - self.sx * self.sy / self.n
        var_x = self.sxx - self.sx * self.sx / self.n
        return max(0.0, min(1.0, cov * cov / (var_x * var_y)))

    def model(self, fallback: StepTimeModel) -> StepTimeModel:
        """The fitted model, or `fallback` while the fit is undefined or unphysical."""
        coef = self.coefficients()
        if coef is None:
            return fallback
        a, b = coef
        if a < 0 or b < 0 or (a == 0 and b == 0):
            return fallback
        return StepTimeModel(a=a, b=b)
