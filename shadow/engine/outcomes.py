"""What a lane counts: its running sums over steps (`LaneTotals`, a step's share added by
`tally_step`, which also prices the step) and its requests' ledger.

`RequestLedger` follows each request from its offer to its finish: the requests in the lane
(`inflight`: offered, not finished nor shed), when each emitted its first token, how many tokens a
seeded one had generated before its seed (`seeded_age`), and across re-seeds which requests were
put in (`reseeded`), finished here before a re-seed put them back (`again`: their second finish is
not counted) or dropped and never finished here (`dropped_unfinished`). At a finish it adds the
request's figures to the totals (`finish`). Pure.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.balance import BalanceTally
from shadow.engine.jobs import Job
from shadow.engine.summary import SampleSink


def _samples() -> SampleSink:
    out: list[float] = []
    return out


@dataclass(slots=True)
class LaneTotals:
    """Running sums over steps and per-request samples, turned into a report by `results`."""

    steps: int = 0
    busy_time_s: float = 0.0
    sum_spread: float = 0.0
    sum_imbalance: float = 0.0
    sum_idle_s: float = 0.0  # Σ a·I(k): worker-seconds spent waiting at the barrier
    worker_time_s: float = 0.0  # Σ over steps of the step time × the workers stepping it
    sum_max: float = 0.0  # Σ max_g L_g(k): re-prices the steps under another step model
    tokens: int = 0
    finished: int = 0
    shed: int = 0  # requests refused at the door (`refuse`) or dropped waiting (`shed_waiting`)
    stalls: int = 0  # live: steps held because a running request's end was not yet known
    first_arrival_s: float = float("inf")
    last_finish_s: float = 0.0
    ttft_s: SampleSink = field(default_factory=_samples)
    tpot_s: SampleSink = field(default_factory=_samples)
    wait_s: SampleSink = field(default_factory=_samples)
    decision_s: SampleSink = field(default_factory=_samples)
    trajectory_t: list[float] = field(default_factory=list)
    trajectory_loads: list[list[float]] = field(default_factory=list)
    balance: BalanceTally = field(default_factory=BalanceTally)  # balance in the field's units


class RequestLedger:
    """See module docstring."""

    __slots__ = ("again", "dropped_unfinished", "first_token", "inflight", "seeded_age")

    def __init__(self) -> None:
        self.inflight: set[Hashable] = set()  # offered, not finished nor shed: offered twice is refused
        self.first_token: dict[Hashable, float] = {}
        self.seeded_age: dict[Hashable, int] = {}  # seeded running requests: tokens before the seed
        # requests the lane had finished that a re-seed put back (their second finish is not counted)
        self.again: set[Hashable] = set()
        self.dropped_unfinished = 0  # dropped at a re-seed, not put back, never finished here

    def reset(self) -> None:
        """Every request dropped (a re-seed; `reseeded` settles them once the seed is in)."""
        self.first_token = {}
        self.seeded_age = {}
        self.inflight = set()

    def reseeded(self, dropped: Sequence[Hashable]) -> frozenset[Hashable]:
        """The seed is in (`inflight`): of the requests `dropped`, count those not put back; returns
        the requests the seed put in."""
        seeded = frozenset(self.inflight)
        for rid in dropped:
            if rid not in seeded:
                if rid in self.again:
                    self.again.discard(rid)
                else:
                    self.dropped_unfinished += 1
        return seeded

    def finish(self, job: Job, out: int, end: float, tt: LaneTotals) -> None:
        """`job` finished at `end` with `out` output tokens: its figures added to `tt`."""
        rid = job.request_id
        if rid in self.again:  # finished here before a re-seed put it back: counted once
            self.again.discard(rid)
        else:
            tt.finished += 1
        tt.last_finish_s = max(tt.last_finish_s, end)
        self.inflight.remove(rid)
        first = self.first_token.pop(rid)
        age = self.seeded_age.pop(rid, 0)
        if age:  # seeded: no first token in this window; TPOT over its tokens since the seed
            tt.tpot_s.append((end - first) / (out - age))
        else:
            tt.ttft_s.append(first - job.arrival_s)
            if out >= 2:
                tt.tpot_s.append((end - first) / (out - 1))


def tally_step(tt: LaneTotals, now: float, loads: list[float], members: tuple[int, ...], shared: bool,
               model: StepTimeModel, models: tuple[StepTimeModel, ...] | None,
               engine_time: tuple[float, float] | None, record_all: bool) -> float:
    """One step of the barrier group `members` at `now`, the loads `loads` before its tokens: its
    time (`engine_time`, (time, idle) in engine mode; else the slowest member's τ_g = a_g·L_g + b_g,
    `model` for all without per-worker `models`) returned, its figures added to `tt` (`shared`: the
    group is the whole fleet; `record_all`: the loads' trajectory kept)."""
    mx, mn, tot = max(loads), min(loads), sum(loads)
    n_workers = len(loads)
    imb = n_workers * mx - tot
    n_members = len(members)
    if engine_time is not None:
        t_step, idle = engine_time
    elif models is None:
        if shared:
            t_step = model.a * mx + model.b
            idle = model.a * imb
        else:
            gmx = max(loads[g] for g in members)
            t_step = model.a * gmx + model.b
            idle = model.a * (n_members * gmx - sum(loads[g] for g in members))
    else:
        taus = [models[g].a * loads[g] + models[g].b for g in members]
        t_step = max(taus)
        idle = len(taus) * t_step - sum(taus)
    tt.steps += 1
    tt.busy_time_s += t_step
    tt.worker_time_s += n_members * t_step
    tt.sum_spread += mx - mn
    tt.sum_imbalance += imb
    tt.sum_idle_s += idle
    tt.sum_max += mx
    tt.balance.add(mx, mn, tot, n_workers, t_step)
    if record_all:
        tt.trajectory_t.append(now)
        tt.trajectory_loads.append(list(loads))
    return t_step
