"""The steady-state measurement protocol: figures that are properties of a policy, not of the
run's length (the protocol is described on `Protocol`; docs/results/protocol.md has its results)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from shadow.base.knobs import NON_NEGATIVE, POSITIVE, Bound, check_knobs, knob
from shadow.core.bra import BRAParams
from shadow.core.intervals import mean_interval, ratio_interval
from shadow.core.params import BRParams
from shadow.core.policies import BASELINE_KINDS, policy
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.driver import Admission, LaneDriver, Observer
from shadow.engine.jobs import Job, jobs_from
from shadow.engine.lane import Clock, Lane
from shadow.engine.summary import SampleSink, percentile
from shadow.traces import (
    DEFAULT_LIMITS,
    Trace,
    TraceLimits,
    at_load,
    estimate_capacity_rps,
    mean_slot_load_tokens,
    resolve,
)
from shadow.traces.model import TraceRequest
from shadow.traces.synthetic import SYNTHETIC_SUFFIX, WORKLOADS, synthetic_workload

ABLATIONS: dict[str, BRAParams] = {
    "bra": BRAParams(),
    "bra{}": BRAParams(score_pick=False, hold=False, scale_window=False),
    "bra{pick}": BRAParams(hold=False, scale_window=False),
    "bra{pick+hold}": BRAParams(scale_window=False),
    "bra{window}": BRAParams(score_pick=False, hold=False),
    "bra{pick+window}": BRAParams(hold=False),
    # hold-back's bounds one at a time (hold0: bounded by hold_s only, the first BRA's hold)
    "bra{pick+hold0}": BRAParams(scale_window=False, hold_life=None, hold_pool=None),
    "bra{pick+hold/life}": BRAParams(scale_window=False, hold_pool=None),
    "bra{pick+hold/pool}": BRAParams(scale_window=False, hold_life=None),
    # the thin-pool basis
    "bra{pick+stay}": BRAParams(hold=False, scale_window=False, basis="stay"),
    "bra{stay}": BRAParams(basis="stay"),
    "bra{prompt}": BRAParams(basis="prompt"),
    "bra{kv}": BRAParams(basis="kv"),
    "bra{final}": BRAParams(basis="final"),
    "bra{life}": BRAParams(basis="life"),
    "bra{mid}": BRAParams(basis="life"),  # the life basis's working name in the first runs
    "bra{near}": BRAParams(basis="near"),
    "bra{pick+kv}": BRAParams(hold=False, scale_window=False, basis="kv"),
    # the first BRA (commit 46e54c3): hold bounded by hold_s only
    "bra{v1}": BRAParams(hold_life=None, hold_pool=None, basis="prompt"),
}

AT_LEAST_TEN = Bound(lambda v: v >= 10, ">= 10")  # requests per run: enough for a window


@dataclass(frozen=True)
class Protocol:
    """How a cell is measured; every field is printed with the results.

    Per cell (workload, G, ρ) and seed:
    - Open-loop arrivals at ρ × the estimated balanced capacity (`estimate_capacity_rps`), the trace's
      arrival shape kept. Synthetic workloads are redrawn per seed; a real trace is rotated to a
      seeded start and tiled (copies laid end to end) up to the request count the window needs.
    - Overload model (the engine's `Admission`), as proxies have: a bounded queue (arrivals refused
      while `queue_per_worker` × G requests wait, the default) or an admission timeout (a request
      still waiting for a decode slot `timeout_s` after it reached the router is shed), both counted.
      They apply identically to the per-worker FIFO queues of bind-at-arrival baselines and to BR's
      pool, so above saturation queues stop growing and a steady state exists.
    - Window: one "lifetime" is mean_output × the balanced saturated step time (how long a slot
      holds a mean request). The first `warmup` lifetimes of arrivals are discarded; the window runs
      `window` lifetimes to the last arrival; the drain after it is discarded (the lane stops there).
      Requests: ⌈(warmup + window) · ρ · G · B⌉ (≈ arrivals per lifetime × lifetimes), capped.
    - Figures inside the window on each lane's own clock: spread per step (step units) and weighted
      by step time (seconds), I(k), barrier idle, throughput, TPOT P95 and TTFT of requests finished
      in it, shed fraction of arrivals in it, decision P99.
    Across seeds: mean and a two-sided 95 % t-interval; ratios against the best baseline are taken
    per seed on the same traffic (paired), then averaged with their t-interval.
    """

    # `knob` fields: `shadow sweep`'s (and `shadow replay --steady`'s) flags (`shadow.base.knobs`);
    # --timeout, --queue (0 = none on the command line) and --seeds (a comma list) are the command's
    warmup_lifetimes: float = knob(3.0, "--warmup", "warm-up discarded, in lifetimes", NON_NEGATIVE)
    window_lifetimes: float = knob(5.0, "--window", "measured window, in lifetimes", POSITIVE)
    timeout_s: float | None = None
    queue_per_worker: int | None = 6  # bounded queue: reject arrivals while waiting >= this × G
    seeds: tuple[int, ...] = (0, 1, 2)
    max_requests: int = knob(40_000, "--max-requests", "cap on requests per run", AT_LEAST_TEN)

    def __post_init__(self) -> None:
        check_knobs(self)  # --warmup, --window, --max-requests: each within its bound, naming its flag
        if self.queue_per_worker is not None and self.queue_per_worker < 1:
            raise ValueError(f"queue bound must be >= 1 per worker (or none), got {self.queue_per_worker!r}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"admission timeout must be > 0 s (or none), got {self.timeout_s!r}")
        if not self.seeds:
            raise ValueError("give at least one seed")

    def describe(self) -> str:
        timeout = "none" if self.timeout_s is None else f"{self.timeout_s:g} s, shed"
        bound = (
            "none" if self.queue_per_worker is None else f"{self.queue_per_worker}×G waiting, arrivals shed"
        )
        return (
            f"steady state: warm-up {self.warmup_lifetimes:g} lifetimes discarded, window "
            f"{self.window_lifetimes:g} lifetimes, drain discarded; admission timeout {timeout}; "
            f"queue bound {bound}; "
            f"seeds {','.join(map(str, self.seeds))} (95% t-interval); ≤ {self.max_requests:,} requests/run"
        )


@dataclass(frozen=True)
class Cell:
    """One (workload, G, ρ, seed) run of several lanes; picklable for worker processes."""

    workload: str
    workers: int
    load: float
    seed: int
    lanes: tuple[str, ...]
    slots: int = 64
    step: StepTimeModel = field(default_factory=StepTimeModel)
    br: BRParams = field(default_factory=BRParams)
    protocol: Protocol = field(default_factory=Protocol)
    trace_limits: TraceLimits = DEFAULT_LIMITS  # what a real trace file is read within


def lane_spec(text: str) -> tuple[LaneSpec, BRAParams | None]:
    """A lane token: a baseline, br0, brh[:pred], bra[:pred] or an ablation like bra{pick+hold}[:pred]."""
    name, _, predictor = text.strip().partition(":")
    if name in ABLATIONS:
        spec = LaneSpec("bra", predictor or "survival", name=name + (f":{predictor}" if predictor else ""))
        return spec, ABLATIONS[name]
    if name.startswith("bra{"):
        raise ValueError(f"unknown BRA ablation {name!r}; known: {list(ABLATIONS)}")
    return LaneSpec.parse(text), None


def workload(spec: str, seed: int, n: int, limits: TraceLimits = DEFAULT_LIMITS) -> Trace:
    """`n` requests of `spec`: a fresh synthetic draw per seed, or a real trace (read within
    `limits`) rotated and tiled."""
    if spec.removesuffix(SYNTHETIC_SUFFIX) in WORKLOADS:
        return synthetic_workload(spec, seed=seed, n=n)
    base = resolve(spec, limits=limits)
    return tile(base, n, seed)


def tile(trace: Trace, n: int, seed: int) -> Trace:
    """`n` requests from `trace` starting at a seeded offset, copies laid end to end (gaps kept)."""
    m = len(trace)
    if m < 2:
        raise ValueError(f"{trace.source}: need at least two requests to tile")
    start = int(np.random.default_rng(seed).integers(m)) if seed else 0
    arr = trace.arrays()["arrival_s"]
    gaps = np.diff(arr, append=arr[-1] + (arr[-1] - arr[0]) / (m - 1))  # wrap gap = mean gap
    out: list[TraceRequest] = []
    t = 0.0
    for k in range(n):
        i = (start + k) % m
        r = trace.requests[i]
        out.append(replace(r, arrival_s=t))
        t += float(gaps[i])
    note = f"{n} requests from offset {start}, tiled" if n > m or start else f"first {n} requests"
    return Trace(trace.name, tuple(out), trace.source, trace.synthetic, f"{trace.notes}; {note}".strip("; "))


def lifetime_s(trace: Trace, slots: int, step: StepTimeModel) -> float:
    """Seconds a slot holds a mean request at balanced saturation: mean_output × (a·B·load + c·B + b)."""
    return trace.mean_output_tokens * step.worker_time(slots * mean_slot_load_tokens(trace), slots)


def requests_needed(cell: Cell) -> int:
    p = cell.protocol
    return min(
        p.max_requests,
        math.ceil((p.warmup_lifetimes + p.window_lifetimes) * cell.load * cell.workers * cell.slots),
    )


def run_cell(cell: Cell, clock: Clock) -> dict[str, Any]:
    """Run every lane of `cell` under the protocol; figures per lane plus the cell's facts."""
    n = requests_needed(cell)
    trace = workload(cell.workload, cell.seed, n, cell.trace_limits)
    capacity = estimate_capacity_rps(
        trace, workers=cell.workers, slots=cell.slots, step_a=cell.step.a, step_b=cell.step.b,
        step_c=cell.step.c,
    )
    trace = at_load(trace, cell.load, capacity)
    jobs = jobs_from(trace.requests)
    life = lifetime_s(trace, cell.slots, cell.step)
    t0 = jobs[0].arrival_s
    t_end = jobs[-1].arrival_s
    t_start = min(t0 + cell.protocol.warmup_lifetimes * life, t_end)
    arrivals_in = sum(1 for j in jobs if t_start <= j.arrival_s < t_end)
    config = EngineConfig(workers=cell.workers, slots=cell.slots, step=cell.step, br=cell.br, seed=cell.seed)
    lanes: dict[str, dict[str, Any]] = {}
    for token in cell.lanes:
        spec, bra = lane_spec(token)
        cfg = config if bra is None else replace(config, bra=bra)
        lane = Lane(spec, cfg, clock)
        cap = (
            None if cell.protocol.queue_per_worker is None else cell.protocol.queue_per_worker * cell.workers
        )
        lanes[spec.label] = drive(lane, jobs, t_start, t_end, cell.protocol.timeout_s, cap) | {
            "arrivals": arrivals_in,
            "policy": spec.policy,
        }
        lanes[spec.label]["shed_fraction"] = lanes[spec.label]["shed"] / arrivals_in if arrivals_in else 0.0
    return {
        "workload": trace.name,
        "workers": cell.workers,
        "load": cell.load,
        "seed": cell.seed,
        "requests": n,
        "capacity_rps": capacity,
        "lifetime_s": life,
        "window_s": t_end - t_start,
        "lanes": lanes,
    }


class _Window(Observer):
    """The window's running figures, read at each step boundary: its start (a snapshot of the
    totals), spread weighted by step time, and the total load before each window step."""

    def __init__(self, t_start: float) -> None:
        self.t_start = t_start
        self.snap: dict[str, float] | None = None
        self.spread_time = 0.0
        self.sum_load = 0.0  # Σ total KV load over window steps (before each step's tokens)
        self._before = (0.0, 0.0, 0.0)

    def stepping(self, lane: Lane) -> None:
        if self.snap is None and lane.now >= self.t_start:
            self.snap = _snapshot(lane)
        tt = lane.totals
        self._before = (tt.sum_spread, tt.busy_time_s, sum(lane.loads))

    def stepped(self, lane: Lane) -> None:
        if self.snap is not None:
            spread0, busy0, load = self._before
            tt = lane.totals
            self.spread_time += (tt.sum_spread - spread0) * (tt.busy_time_s - busy0)
            self.sum_load += load


def drive(
    lane: Lane,
    jobs: Sequence[Job],
    t_start: float,
    t_end: float,
    timeout_s: float | None,
    queue_cap: int | None = None,
) -> dict[str, Any]:
    """Drive `lane` through `jobs` (arrival order, no prefill stage) until `t_end`; window figures."""
    window = _Window(t_start)
    driver = LaneDriver(lane, admission=Admission(queue_cap, timeout_s), observers=(window,), stop_at=t_end)
    for job in jobs:
        if not driver.offer(job, job.arrival_s):
            break
    else:
        driver.run_out()
    tt = lane.totals
    snap = window.snap if window.snap is not None else _snapshot(lane)
    end = _snapshot(lane, window.sum_load)
    spread_time = window.spread_time
    steps = end["steps"] - snap["steps"]
    busy = end["busy"] - snap["busy"]
    span = end["now"] - snap["now"]
    f0, f1 = int(snap["finished"]), int(end["finished"])
    tpot = [x for x in _exact(tt.tpot_s)[int(snap["tpot"]) : int(end["tpot"])]]
    ttft = _exact(tt.ttft_s)[f0:f1]
    dec = _exact(tt.decision_s)[int(snap["decisions"]) : int(end["decisions"])]
    g = lane.config.workers
    weighed = end["balance_t"] - snap["balance_t"]
    ratio = (end["balance_tr"] - snap["balance_tr"]) / weighed if weighed > 0 else None
    throughput = (end["tokens"] - snap["tokens"]) / span if span > 0 else 0.0
    return {
        "steps": int(steps),
        "spread_steps": (end["spread"] - snap["spread"]) / steps if steps else 0.0,
        "spread_seconds": spread_time / busy if busy > 0 else 0.0,
        "imbalance": (end["imbalance"] - snap["imbalance"]) / steps if steps else 0.0,
        "idle_fraction": (end["idle"] - snap["idle"]) / (g * busy) if busy > 0 else 0.0,
        "throughput_tps": throughput,
        "running_per_step": (end["tokens"] - snap["tokens"]) / steps if steps else 0.0,
        "mean_step_ms": 1e3 * busy / steps if steps else 0.0,
        "mean_load": (end["load"] - snap["load"]) / steps if steps else 0.0,
        "finished": f1 - f0,
        "shed": int(end["shed"] - snap["shed"]),
        "tpot_p95_ms": _pct(tpot, 95),
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p99_ms": _pct(ttft, 99),
        "decision_p99_ms": _pct(dec, 99),
        # NVIDIA's balance ratio over the window (step-time-weighted mean of mean/max KV load) and
        # its speed-of-light throughput (`shadow.engine.balance`)
        "balance_ratio": ratio,
        "sol_throughput_tps": throughput / ratio if ratio else None,
    }


def _snapshot(lane: Lane, sum_load: float = 0.0) -> dict[str, float]:
    t = lane.totals
    return {
        "load": sum_load,
        "now": lane.now,
        "steps": t.steps,
        "busy": t.busy_time_s,
        "spread": t.sum_spread,
        "imbalance": t.sum_imbalance,
        "idle": t.sum_idle_s,
        "tokens": t.tokens,
        "finished": t.finished,
        "tpot": len(t.tpot_s),
        "shed": t.shed,
        "decisions": len(t.decision_s),
        "balance_t": t.balance.sum_t,
        "balance_tr": t.balance.sum_tr,
    }


def _pct(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q, 1e3)


# -- aggregation over seeds -----------------------------------------------------------------

NO_INTERVAL = (math.nan, 0.0)  # a figure with no value over the seeds


def summarise(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, G, ρ): each lane's figures over seeds, and paired ratios to the best baseline."""
    cells: dict[tuple[str, int, float], list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["workload"], r["workers"], r["load"]), []).append(r)
    out: list[dict[str, Any]] = []
    for (name, g, rho), rs in sorted(cells.items()):
        rs = sorted(rs, key=lambda r: r["seed"])
        labels = list(rs[0]["lanes"])
        base = [lb for lb in labels if policy(rs[0]["lanes"][lb]["policy"]).kind in BASELINE_KINDS]

        def mean_of(label: str, key: str, rs: list[dict[str, Any]] = rs) -> float:
            vals = [r["lanes"][label][key] for r in rs if r["lanes"][label][key] is not None]
            return sum(vals) / len(vals) if vals else math.nan

        best_s = min(base, key=lambda lb: mean_of(lb, "spread_steps")) if base else None
        best_t = max(base, key=lambda lb: mean_of(lb, "throughput_tps")) if base else None
        best_p = min(base, key=lambda lb: mean_of(lb, "tpot_p95_ms")) if base else None
        best_sec = min(base, key=lambda lb: mean_of(lb, "spread_seconds")) if base else None
        lanes: dict[str, Any] = {}
        for lb in labels:
            row: dict[str, Any] = {"policy": rs[0]["lanes"][lb]["policy"]}
            for key in (
                "spread_steps",
                "spread_seconds",
                "imbalance",
                "idle_fraction",
                "throughput_tps",
                "tpot_p95_ms",
                "ttft_p99_ms",
                "shed_fraction",
                "decision_p99_ms",
                "balance_ratio",
                "sol_throughput_tps",
            ):
                vals = [v for r in rs if (v := r["lanes"][lb].get(key)) is not None]  # (older files: none)
                row[key] = mean_interval(vals) if vals else NO_INTERVAL
            if best_s is not None:
                row["spread_x"] = _paired(rs, best_s, lb, "spread_steps", invert=True)
                row["spread_seconds_x"] = _paired(rs, best_sec or best_s, lb, "spread_seconds", invert=True)
                row["throughput_pct"] = _paired_pct(rs, best_t or best_s, lb, "throughput_tps")
                row["tpot_p95_pct"] = _paired_pct(rs, best_p or best_s, lb, "tpot_p95_ms")
            lanes[lb] = row
        out.append(
            {
                "workload": name,
                "workers": g,
                "load": rho,
                "seeds": [r["seed"] for r in rs],
                "requests": rs[0]["requests"],
                "window_s": mean_interval([r["window_s"] for r in rs])[0],
                "lifetime_s": rs[0]["lifetime_s"],
                "best_baseline_spread": best_s,
                "best_baseline_throughput": best_t,
                "best_baseline_tpot": best_p,
                "lanes": lanes,
            }
        )
    return out


def _ratios(rs: Sequence[dict[str, Any]], ref: str, lb: str, key: str) -> list[float]:
    """Per seed: lane `lb`'s `key` over reference `ref`'s (seeds where either is missing or zero
    are left out)."""
    return [r["lanes"][lb][key] / r["lanes"][ref][key] for r in rs
            if r["lanes"][ref][key] and r["lanes"][lb][key]]


def _paired(rs: Sequence[dict[str, Any]], ref: str, lb: str, key: str, invert: bool) -> tuple[float, ...]:
    """(ratio, low, high): the geometric mean over seeds of `ref`/`lb` (`invert`) or `lb`/`ref`, with
    its 95 % interval on the log scale (`core.intervals.ratio_interval`: both bounds positive);
    NaN where there is no pair, and no bounds below three seeds."""
    iv = ratio_interval(_ratios(rs, ref, lb, key))
    if invert:
        iv = iv.inverted()
    return _nan_for_none(iv.ratio, iv.low, iv.high)


def _paired_pct(rs: Sequence[dict[str, Any]], ref: str, lb: str, key: str) -> tuple[float, ...]:
    """(change %, low, high) of `lb` against `ref` over seeds: the paired ratio's estimate and bounds
    as percentages (never below −100 %)."""
    iv = ratio_interval(_ratios(rs, ref, lb, key))
    return _nan_for_none(*(None if v is None else 100.0 * (v - 1.0) for v in (iv.ratio, iv.low, iv.high)))


def _nan_for_none(*values: float | None) -> tuple[float, ...]:
    return tuple(math.nan if v is None else v for v in values)


def bounds(entry: Sequence[float]) -> tuple[float, float, float]:
    """(estimate, low, high) of a summary entry: `(mean, half)` of a figure or `(ratio, low, high)` of
    a paired ratio or change (files written before ratios had their own bounds hold `(mean, half)`
    there too)."""
    if len(entry) == 2:
        mean, half = entry
        return mean, mean - half, mean + half
    est, low, high = entry
    return est, low, high


def interval_text(entry: Sequence[float], fmt: str) -> str:
    """A summary entry as tables print it: "12.3 ± 0.4" for `(mean, half)`, "1.10 (0.95–1.27)" for
    `(ratio, low, high)` (without bounds below three seeds), "–" without a value."""
    est = entry[0]
    if est is None or math.isnan(est):
        return "–"
    if len(entry) == 2:
        return f"{est:{fmt}} ± {entry[1]:{fmt.lstrip('+')}}"
    low, high = entry[1], entry[2]
    if math.isnan(low) or math.isnan(high):
        return f"{est:{fmt}}"
    return f"{est:{fmt}} ({low:{fmt}}–{high:{fmt}})"


def cells_for(
    workloads: Sequence[str],
    workers: Sequence[int],
    loads: Sequence[float],
    lanes: Sequence[str],
    base: Cell,
) -> list[Cell]:
    """Every (workload, G, ρ, seed) cell, largest first (better packing on a process pool)."""
    for token in lanes:
        lane_spec(token)
    cells = [
        replace(base, workload=w, workers=g, load=rho, seed=s, lanes=tuple(lanes))
        for w in workloads
        for g in workers
        for rho in loads
        for s in base.protocol.seeds
    ]
    return sorted(cells, key=lambda c: -c.workers * c.load)


def run_cells(
    cells: Sequence[Cell],
    processes: int,
    on_done: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run cells locally, in `processes` worker processes (1 = in this process)."""
    import time

    out: list[dict[str, Any]] = []
    if processes <= 1:
        for c in cells:
            r = run_cell(c, time.perf_counter)
            out.append(r)
            if on_done is not None:
                on_done(r)
        return out
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        for r in pool.imap_unordered(_run_cell_timed, cells):
            out.append(r)
            if on_done is not None:
                on_done(r)
    return out


def _run_cell_timed(cell: Cell) -> dict[str, Any]:
    import time

    return run_cell(cell, time.perf_counter)


def _exact(samples: SampleSink) -> list[float]:
    """Offline lanes keep every sample in a list (live lanes keep bounded histograms)."""
    assert isinstance(samples, list)
    return samples
