"""BalanceRoute parameters and their validation (every invalid value is a clear ValueError)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

NewcomerMode = Literal["grow", "constant"]


@dataclass(frozen=True, slots=True)
class BRParams:
    """Knobs of BR-0/BR-H; defaults follow DESIGN.md §5 and the paper notes §8.

    horizon: H (steps of look-ahead; BR-0 ignores it). alpha/beta/gamma: BR-H fill reward,
    overflow penalty and discount (beta > alpha). s_greedy: Stage 1 runs while total free slots
    exceed it (None means G). r_max: Stage 2 window (exhaustive search up to
    `exhaustive_max`, bitset subset-sum above). age_s: pool entries older than this go to the
    front of the window (None disables aging). newcomer: how an admitted request enters the
    BR-H projection ("grow": s + h while predicted present; "constant": s over the horizon).
    """

    horizon: int = 80
    alpha: float = 1.0
    beta: float = 43.0
    gamma: float = 0.86
    s_greedy: int | None = None
    r_max: int = 4
    exhaustive_max: int = 4
    age_s: float | None = 2.0
    newcomer: NewcomerMode = "grow"

    def __post_init__(self) -> None:
        if (
            isinstance(self.horizon, bool)
            or not isinstance(self.horizon, int)
            or not 0 <= self.horizon <= 4096
        ):
            raise ValueError(f"horizon H must be an integer in [0, 4096], got {self.horizon!r}")
        for name in ("alpha", "beta", "gamma"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")
        if self.beta <= self.alpha:
            raise ValueError(
                f"beta must be greater than alpha (got beta={self.beta!r}, alpha={self.alpha!r}): "
                "with beta <= alpha every admission scores positive and the largest sum always wins"
            )
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma!r}")
        if self.s_greedy is not None and (
            isinstance(self.s_greedy, bool) or not isinstance(self.s_greedy, int) or self.s_greedy < 0
        ):
            raise ValueError(f"s_greedy must be an integer >= 0 or None (= G), got {self.s_greedy!r}")
        if isinstance(self.r_max, bool) or not isinstance(self.r_max, int) or not 1 <= self.r_max <= 16:
            raise ValueError(f"r_max must be an integer in [1, 16], got {self.r_max!r}")
        if not isinstance(self.exhaustive_max, int) or not 0 <= self.exhaustive_max <= 16:
            raise ValueError(f"exhaustive_max must be an integer in [0, 16], got {self.exhaustive_max!r}")
        if self.age_s is not None and (not isinstance(self.age_s, int | float) or not self.age_s >= 0):
            raise ValueError(f"age_s must be a number >= 0 or None, got {self.age_s!r}")
        if self.newcomer not in ("grow", "constant"):
            raise ValueError(f"newcomer must be 'grow' or 'constant', got {self.newcomer!r}")

    def greedy_threshold(self, workers: int) -> int:
        """S_greedy for a fleet of `workers` (the default is G)."""
        return workers if self.s_greedy is None else self.s_greedy

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | BRParams | None) -> BRParams:
        """Build from a dict of overrides (unknown keys are an error) or pass a BRParams through."""
        if values is None:
            return cls()
        if isinstance(values, BRParams):
            return values
        if not isinstance(values, Mapping):
            raise ValueError(f"params must be a mapping or BRParams, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown BalanceRoute parameter(s) {unknown}; known: {sorted(known)}")
        return replace(cls(), **dict(values))


def br0_equivalent(workers: int) -> BRParams:
    """BR-H parameters that reproduce BR-0 exactly: H=0, alpha=1, beta=G."""
    return BRParams(horizon=0, alpha=1.0, beta=float(workers))
