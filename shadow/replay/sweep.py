"""Sweeps: the replay over a grid of G, load ρ and BR-H (β, γ), summarised as BR's gain per cell.

Baseline lanes do not depend on (β, γ), so they run once per (G, ρ); BR lanes run per (β, γ).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from shadow.core.policies import BASELINE_KINDS, policy
from shadow.engine.config import LaneSpec
from shadow.replay.experiment import ReplaySetup, run_replay
from shadow.traces import Trace


@dataclass(frozen=True)
class SweepRow:
    """One cell: a BR lane against the best baseline of the same (G, ρ)."""

    workers: int
    load: float | None
    beta: float
    gamma: float
    lane: str
    best_baseline: str
    baseline_spread: float
    spread: float
    spread_reduction_x: float
    best_throughput_baseline: str
    throughput_gain_pct: float
    by_policy_spread: dict[str, float]
    by_policy_throughput: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def run_sweep(
    trace: Trace,
    base: ReplaySetup,
    workers: Sequence[int],
    loads: Sequence[float | None],
    betas: Sequence[float],
    gammas: Sequence[float],
    on_cell: Callable[[str], None] | None = None,
) -> list[SweepRow]:
    """Every (G, ρ, β, γ) cell; `base.policies` are split into baselines and BR lanes."""
    baselines = tuple(p for p in base.policies if policy(LaneSpec.parse(p).policy).kind in BASELINE_KINDS)
    brs = tuple(p for p in base.policies if p not in baselines)
    if not baselines or not brs:
        raise ValueError("a sweep needs at least one baseline and one BR policy")
    rows: list[SweepRow] = []
    for g in workers:
        for rho in loads:
            ref = run_replay(trace, replace(base, workers=g, load=rho, policies=baselines))
            spreads = {k: r.avg_spread_tokens for k, r in ref.results.items()}
            thr = {k: r.throughput_tokens_per_s for k, r in ref.results.items()}
            best_s = min(spreads, key=lambda k: spreads[k])
            best_t = max(thr, key=lambda k: thr[k])
            for beta in betas:
                for gamma in gammas:
                    if on_cell is not None:
                        on_cell(f"G={g} ρ={rho} β={beta} γ={gamma}")
                    br = replace(base.br, beta=beta, gamma=gamma)
                    rep = run_replay(trace, replace(base, workers=g, load=rho, policies=brs, br=br))
                    for label, r in rep.results.items():
                        rows.append(
                            SweepRow(
                                workers=g,
                                load=rho,
                                beta=beta,
                                gamma=gamma,
                                lane=label,
                                best_baseline=best_s,
                                baseline_spread=spreads[best_s],
                                spread=r.avg_spread_tokens,
                                spread_reduction_x=spreads[best_s] / r.avg_spread_tokens
                                if r.avg_spread_tokens
                                else float("inf"),
                                best_throughput_baseline=best_t,
                                throughput_gain_pct=100.0 * (r.throughput_tokens_per_s / thr[best_t] - 1.0),
                                by_policy_spread=spreads | {label: r.avg_spread_tokens},
                                by_policy_throughput=thr | {label: r.throughput_tokens_per_s},
                            )
                        )
    return rows
