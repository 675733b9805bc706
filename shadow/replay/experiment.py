"""One replay experiment: resolve the workload, set the load, run the lanes, compare.

Kept apart from the CLI so tests, the demo and sweeps call the same thing.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from shadow.core.cost import RouteCost
from shadow.core.params import BRParams
from shadow.core.policies import BASELINE_KINDS, policy
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneClock, LaneSpec, PrefillConfig
from shadow.engine.jobs import jobs_from
from shadow.engine.offline import Progress, run_offline
from shadow.engine.results import LaneResult
from shadow.engine.settings import LaneSettings, clock_to_json
from shadow.traces import Trace, at_load, estimate_capacity_rps, scale_rate

DEFAULT_POLICIES: tuple[str, ...] = (
    "rr",
    "random",
    "p2c",
    "jsq",
    "jsq-bytes",
    "least-tokens",
    "br0",
    "brh:survival",
    "brh:exactmatch",
    "brh:oracle",
)


@dataclass(frozen=True)
class ReplaySetup:
    """Everything that defines a replay besides the trace."""

    workers: int = 8
    workers_given: bool = False  # True when the user set -G (a recording must then agree)
    slots: int = 64
    policies: tuple[str, ...] = DEFAULT_POLICIES
    load: float | None = None  # ρ relative to estimated capacity; None keeps the trace's rate
    rate_scale: float | None = None
    step: StepTimeModel = field(default_factory=StepTimeModel)
    prefill: PrefillConfig | None = None
    br: BRParams = field(default_factory=BRParams)
    seed: int = 0
    trajectory_points: int = 0
    clock: LaneClock | None = None  # per-worker step models and barrier groups (a recording's fitted ones)


@dataclass(frozen=True)
class ReplayReport:
    """Results per lane plus what is needed to read them honestly."""

    workload: dict[str, Any]
    config: dict[str, Any]
    results: dict[str, LaneResult]
    wall_s: float

    def best_baseline(self, metric: str = "avg_spread_tokens", lower: bool = True) -> str | None:
        """Label of the best baseline lane by `metric`."""
        cands = [r for r in self.results.values() if policy(r.policy).kind in BASELINE_KINDS]
        if not cands:
            return None
        pick = min if lower else max
        return pick(cands, key=lambda r: getattr(r, metric)).label

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "config": self.config,
            "results": {k: v.figures() for k, v in self.results.items()},
            "comparison": self.comparison(),
        }

    def comparison(self) -> dict[str, Any]:
        """BR lanes against the best baseline: spread ratio (×) and throughput gain (%)."""
        spread_ref = self.best_baseline("avg_spread_tokens", lower=True)
        thr_ref = self.best_baseline("throughput_tokens_per_s", lower=False)
        out: dict[str, Any] = {"best_baseline_spread": spread_ref, "best_baseline_throughput": thr_ref}
        if spread_ref is None or thr_ref is None:
            return out
        base_spread = self.results[spread_ref].avg_spread_tokens
        base_thr = self.results[thr_ref].throughput_tokens_per_s
        for label, r in self.results.items():
            if r.policy in ("br0", "brh"):
                out[label] = {
                    "spread_reduction_x": base_spread / r.avg_spread_tokens if r.avg_spread_tokens else None,
                    "throughput_gain_pct": 100.0 * (r.throughput_tokens_per_s / base_thr - 1.0)
                    if base_thr
                    else None,
                }
        return out


#: Settings a replay can take from a recording, by the name the replay's flags give them.
BR_FIELDS = {"horizon": "horizon", "alpha": "alpha", "beta": "beta", "gamma": "gamma", "r_max": "r_max",
             "s_greedy": "s_greedy", "age": "age_s"}


def as_recorded(
    setup: ReplaySetup, recorded: LaneSettings, given: Collection[str]
) -> tuple[ReplaySetup, list[str]]:
    """`setup` with every setting the recording's lanes ran with, except those named in `given`
    (flags the user set, by their names: step_a, step_b, step_c, step_p, slots, policies, seed,
    BR_FIELDS' keys);
    returns it with one line per setting that departs from the recording (a deliberate what-if)."""
    step = StepTimeModel(
        *(getattr(setup.step if f"step_{t}" in given else recorded.step, t) for t in ("a", "b", "c", "p"))
    )
    br = replace(recorded.br, **{f: getattr(setup.br, f) for k, f in BR_FIELDS.items() if k in given})
    out = replace(
        setup,
        step=step,
        br=br,
        slots=setup.slots if "slots" in given else recorded.slots,
        policies=setup.policies if "policies" in given else recorded.policies,
        seed=setup.seed if "seed" in given else recorded.seed,
    )
    now = LaneSettings(policies=out.policies, step=out.step, slots=out.slots, br=out.br, seed=out.seed,
                       rolling_s=recorded.rolling_s)
    return out, recorded.differences(now)


def route_cost(setup: ReplaySetup) -> RouteCost:
    """What the lanes' BalanceRoute policies balance: the cost of the models they step on."""
    models = setup.clock.models if setup.clock is not None else None
    return RouteCost.fleet(models) if models else RouteCost.of(setup.step)


def run_replay(trace: Trace, setup: ReplaySetup, progress: Progress | None = None) -> ReplayReport:
    """Replay `trace` under `setup`; arrivals rescaled to ρ (or by rate_scale) first."""
    if not len(trace):
        raise ValueError(f"{trace.source}: the trace has no requests")
    lanes = [LaneSpec.parse(p) for p in setup.policies]
    # A recorded session knows where the real router sent each request: add the `actual` lane,
    # and size the fleet by the configured workers (its header), or else by the workers seen —
    # a worker that got no traffic is still a worker. An explicit -G must agree.
    worker_names: list[str] = []
    if all(r.worker is not None for r in trace.requests):
        seen = {r.worker for r in trace.requests if r.worker is not None}
        worker_names = list(trace.workers) if trace.workers else sorted(seen)
        if setup.workers_given and setup.workers != len(worker_names):
            raise ValueError(
                f"-G {setup.workers} does not match the recording's {len(worker_names)} workers "
                f"({', '.join(worker_names)})"
            )
        setup = replace(setup, workers=len(worker_names))
        lanes.insert(0, LaneSpec("forced", name="actual"))
    capacity = estimate_capacity_rps(
        trace, workers=setup.workers, slots=setup.slots, step_a=setup.step.a, step_b=setup.step.b,
        step_c=setup.step.c,
    )
    if setup.load is not None and setup.rate_scale is not None:
        raise ValueError("give either a load (rho) or a rate scale, not both")
    if setup.load is not None:
        trace = at_load(trace, setup.load, capacity)
    elif setup.rate_scale is not None:
        trace = scale_rate(trace, setup.rate_scale)
    rate = trace.mean_rate_rps
    config = EngineConfig(
        workers=setup.workers,
        slots=setup.slots,
        step=setup.step,
        prefill=setup.prefill,
        br=setup.br,
        seed=setup.seed,
        trajectory_points=setup.trajectory_points,
        clock=setup.clock,
    )
    jobs = jobs_from(trace.requests)
    index = {name: g for g, name in enumerate(worker_names)}
    forced = {
        job.request_id: index[r.worker] for job, r in zip(jobs, trace.requests, strict=True) if r.worker
    }
    t0 = time.perf_counter()
    results = run_offline(jobs, config, lanes, time.perf_counter, progress, forced=forced or None)
    wall = time.perf_counter() - t0
    workload = {
        "name": trace.name,
        "source": trace.source,
        "synthetic": trace.synthetic,
        "notes": trace.notes,
        "requests": len(trace),
        "mean_prompt_tokens": trace.mean_prompt_tokens,
        "mean_output_tokens": trace.mean_output_tokens,
        "mean_rate_rps": rate,
        "estimated_capacity_rps": capacity,
        "rho": rate / capacity if capacity > 0 else None,
    }
    cfg = {
        "workers": setup.workers,
        "slots": setup.slots,
        "step_a_s_per_token": setup.step.a,
        "step_b_s": setup.step.b,
        "step_c_s_per_seq": setup.step.c,
        "step_p_s_per_prefill_token": setup.step.p,
        "route_cost": route_cost(setup).describe(),
        "clock": None if setup.clock is None else clock_to_json(setup.clock),
        "prefill": None if setup.prefill is None else asdict(setup.prefill),
        "br": asdict(setup.br),
        "seed": setup.seed,
        "policies": [lane.label for lane in lanes],
        "worker_names": worker_names or None,
    }
    return ReplayReport(workload=workload, config=cfg, results=results, wall_s=wall)


def parse_policies(text: str | Sequence[str]) -> tuple[str, ...]:
    """ "rr,jsq,br0" or a list; each validated as a lane spec (ValueError on unknown)."""
    items = [p for part in ([text] if isinstance(text, str) else text) for p in part.split(",") if p.strip()]
    for item in items:
        LaneSpec.parse(item)
    if not items:
        raise ValueError("no policies given")
    return tuple(item.strip() for item in items)
