"""Decode step-time model τ_g = a·L_g + c·n_g + p·P_g + b (the paper's T = a·max_g L_g + b when
c = p = 0), and its online least-squares fit.

`StepTimeModel` is the model with fixed coefficients (used by the engine and the simulated
fleet); `SlidingFit` fits (a, b) with their R² over the most recent (max load, measured step
time) samples, so that dashboards can say when KV tokens do not drive step time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

# Defaults: ≈ 60 ms per step at the paper-like load (G=8, B=64, ≈ 5.2 k KV tokens per request,
# max load ≈ 333 k tokens): 0.020 s + 1.2e-7 s/token × 333 k ≈ 0.060 s.
DEFAULT_A_S_PER_TOKEN = 1.2e-7
DEFAULT_B_S = 0.020
#: How many recent samples a step-time fit covers (`SlidingFit`; the live lanes' windows).
FIT_WINDOW = 600


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """A worker's step compute time τ_g = a·L_g + c·n_g + p·P_g + b, in seconds: `a` per KV token it
    holds (L_g), `c` per running sequence (n_g: sampling, scheduling, small-batch GEMMs), `p` per
    prefill token scheduled into the step (P_g, where an engine mixes prefill chunks into decode
    steps), `b` fixed. The paper's model is c = p = 0: T(k) = a·max_g L_g(k) + b. Under a barrier a
    step lasts the max over the group of τ_g."""

    a: float = DEFAULT_A_S_PER_TOKEN
    b: float = DEFAULT_B_S
    c: float = 0.0
    p: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "p"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"step model: {name} must be a finite number >= 0, got {v!r}")
        if self.a == 0 and self.b == 0 and self.c == 0 and self.p == 0:
            raise ValueError("step model: a, b, c and p cannot all be 0 (steps would take no time)")

    @property
    def linear(self) -> bool:
        """The paper's form (no per-sequence or prefill term)."""
        return self.c == 0 and self.p == 0

    @property
    def kappa_tokens(self) -> float:
        """The per-sequence term in KV tokens, κ = c/a: a running sequence costs a step what κ more
        KV tokens would (0 without a per-sequence term; infinite when KV tokens cost nothing)."""
        if self.c == 0:
            return 0.0
        return self.c / self.a if self.a > 0 else math.inf

    def step_time(self, max_load: float) -> float:
        """Barrier step time for a step whose heaviest worker holds `max_load` KV tokens (the
        paper's form: the c and p terms are not in it)."""
        return self.a * max_load + self.b

    def worker_time(self, load: float, seqs: float = 0.0, prefill_tokens: float = 0.0) -> float:
        """Compute time of one worker holding `load` KV tokens over `seqs` running sequences, with
        `prefill_tokens` scheduled into the step (before the barrier)."""
        return self.a * load + self.c * seqs + self.p * prefill_tokens + self.b

    def describe(self) -> str:
        """Its terms for a message: "a=… s/token, b=… s", and c, p where they are not 0."""
        out = f"a={self.a:g} s/token, b={self.b:g} s"
        if self.c:
            out += f", c={self.c:g} s/sequence"
        if self.p:
            out += f", p={self.p:g} s/prefill token"
        return out


@dataclass(frozen=True, slots=True)
class FitResult:
    """A fit of T = a·max L + b: its coefficients and R², the samples and load range it saw."""

    a_s_per_token: float | None
    b_s: float | None
    r2: float | None
    samples: int
    quality: str  # "good", "poor" (R² low or load range too narrow), "insufficient" (too few samples)
    x_min: float | None = None
    x_max: float | None = None

    def model(self, fallback: StepTimeModel) -> StepTimeModel:
        """The fitted model when the fit is good, else `fallback`."""
        if self.quality != "good" or self.a_s_per_token is None or self.b_s is None:
            return fallback
        return StepTimeModel(a=self.a_s_per_token, b=self.b_s)


class SlidingFit:
    """Least squares of step time on max load over the most recent `size` samples; `result()`
    says "good" only with `min_samples`, a load range that identifies the slope and R² >= `min_r2`
    (a slope <= 0 or an intercept < 0 is "poor"). Non-finite, negative-load and non-positive-time
    samples are not taken."""

    def __init__(self, size: int = FIT_WINDOW, *, min_samples: int = 20, min_r2: float = 0.9) -> None:
        self.xs: deque[float] = deque(maxlen=size)
        self.ys: deque[float] = deque(maxlen=size)
        self.min_samples = min_samples
        self.min_r2 = min_r2

    def add(self, max_load: float, step_s: float) -> None:
        if math.isfinite(max_load) and math.isfinite(step_s) and max_load >= 0 and step_s > 0:
            self.xs.append(max_load)
            self.ys.append(step_s)

    def result(self) -> FitResult:
        n = len(self.xs)
        if n < 2:
            return FitResult(None, None, None, n, "insufficient")
        x = np.asarray(self.xs)
        y = np.asarray(self.ys)
        xm, ym = float(x.mean()), float(y.mean())
        vx = float(((x - xm) ** 2).sum())
        vy = float(((y - ym) ** 2).sum())
        lo, hi = float(x.min()), float(x.max())
        if vx <= 1e-12 * max(1.0, float((x * x).sum())):
            return FitResult(None, None, None, n, "poor" if n >= self.min_samples else "insufficient", lo, hi)
        cov = float(((x - xm) * (y - ym)).sum())
        a = cov / vx
        b = ym - a * xm
        r2 = cov * cov / (vx * vy) if vy > 0 else 1.0
        if n < self.min_samples:
            quality = "insufficient"
        elif r2 < self.min_r2 or a <= 0 or b < 0:
            quality = "poor"
        else:
            quality = "good"
        return FitResult(a, b, max(0.0, min(1.0, r2)), n, quality, lo, hi)
