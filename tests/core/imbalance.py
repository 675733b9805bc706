"""Imbalance math of a barrier-synchronised step, written out for the tests to check the engine
against: I(k), max−min spread, barrier-idle fraction."""

from __future__ import annotations

from collections.abc import Sequence

from shadow.core.stepmodel import StepTimeModel


def imbalance(loads: Sequence[float]) -> float:
    """I(k) = G·max L − Σ L = Σ_g (max L − L_g): total barrier gap in KV tokens."""
    if not loads:
        return 0.0
    return float(len(loads) * max(loads) - sum(loads))


def spread(loads: Sequence[float]) -> float:
    """max L − min L, the paper's reported imbalance metric (KV tokens)."""
    if not loads:
        return 0.0
    return float(max(loads) - min(loads))


def barrier_idle_fraction(loads: Sequence[float], model: StepTimeModel) -> float:
    """Σ_g (T − τ_g) / (G·T) = a·I / (G·T) under T = a·max L + b, τ_g = a·L_g + b."""
    if not loads:
        return 0.0
    step = model.step_time(max(loads))
    if step <= 0:
        return 0.0
    return model.a * imbalance(loads) / (len(loads) * step)
