"""Per-lane figures from a finished run: the numbers `shadow replay` prints and writes as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shadow.contracts.report import BalanceFigures
from shadow.engine.balance import BalanceTally
from shadow.engine.lane import Lane
from shadow.engine.summary import percentile

_pct = percentile


@dataclass(frozen=True, slots=True)
class LaneResult:
    """Figures of one lane; times in ms where named so, tokens in KV tokens."""

    label: str
    policy: str
    predictor: str | None
    offline_bound: bool
    requests: int
    finished: int
    tokens: int
    steps: int
    avg_spread_tokens: float
    avg_imbalance_tokens: float
    barrier_idle_fraction: float
    throughput_tokens_per_s: float
    mean_step_ms: float
    tpot_p50_ms: float | None
    tpot_p95_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    wait_p50_ms: float | None
    wait_p99_ms: float | None
    decision_ms_p50: float | None
    decision_ms_p99: float | None
    makespan_s: float
    balance: BalanceFigures = field(default_factory=lambda: BalanceTally().figures(None))  # `engine.balance`
    trajectory_t: list[float] = field(default_factory=list, repr=False)
    trajectory_loads: list[list[float]] = field(default_factory=list, repr=False)

    def figures(self) -> dict[str, Any]:
        """The JSON figures (no trajectories)."""
        out = asdict(self)
        out.pop("trajectory_t")
        out.pop("trajectory_loads")
        out.update(out.pop("balance"))
        return out


def lane_result(lane: Lane, requests: int, points: int) -> LaneResult:
    """Summarise a lane after its run."""
    t = lane.totals
    steps = max(t.steps, 1)
    makespan = max(t.last_finish_s - (t.first_arrival_s if t.finished else 0.0), 0.0)
    total_worker_time = t.worker_time_s
    traj_t, traj_l = t.trajectory_t, t.trajectory_loads
    throughput = t.tokens / makespan if makespan > 0 else 0.0
    if points and len(traj_t) > points:
        stride = -(-len(traj_t) // points)
        traj_t, traj_l = traj_t[::stride], traj_l[::stride]
    return LaneResult(
        label=lane.spec.label,
        policy=lane.spec.policy,
        predictor=lane.spec.predictor,
        offline_bound=lane.spec.predictor == "oracle",
        requests=requests,
        finished=t.finished,
        tokens=t.tokens,
        steps=t.steps,
        avg_spread_tokens=t.sum_spread / steps,
        avg_imbalance_tokens=t.sum_imbalance / steps,
        barrier_idle_fraction=t.sum_idle_s / total_worker_time if total_worker_time > 0 else 0.0,
        throughput_tokens_per_s=throughput,
        mean_step_ms=1e3 * t.busy_time_s / steps,
        tpot_p50_ms=_pct(t.tpot_s, 50, 1e3),
        tpot_p95_ms=_pct(t.tpot_s, 95, 1e3),
        ttft_p50_ms=_pct(t.ttft_s, 50, 1e3),
        ttft_p99_ms=_pct(t.ttft_s, 99, 1e3),
        wait_p50_ms=_pct(t.wait_s, 50, 1e3),
        wait_p99_ms=_pct(t.wait_s, 99, 1e3),
        decision_ms_p50=_pct(t.decision_s, 50, 1e3),
        decision_ms_p99=_pct(t.decision_s, 99, 1e3),
        makespan_s=makespan,
        balance=t.balance.figures(throughput),
        trajectory_t=list(traj_t),
        trajectory_loads=[list(x) for x in traj_l],
    )
