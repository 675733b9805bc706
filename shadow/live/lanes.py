"""Live lanes off the relay loop: a bounded event queue, one worker thread, published snapshots."""

from __future__ import annotations

import operator
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shadow.contracts.events import Event, Step
from shadow.contracts.report import (
    Comparison,
    FidelityReport,
    LaneReport,
    LaneState,
    LastWindow,
    Report,
    RollingReport,
    StepModelReport,
    WindowFigures,
)
from shadow.core.hostfactor import HOST_WINDOWS
from shadow.core.params import BRParams
from shadow.core.policies import RouterOptions, make_router
from shadow.core.pool import Pool
from shadow.core.routers import PoolRouter, Router
from shadow.core.stepcost import OOS_ERROR_MAX, PERIOD_ERROR_MAX, CostFit
from shadow.core.stepmodel import FitResult, SlidingFit, StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.driver import Observer
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.engine.live import ACTUAL, LiveDriver
from shadow.engine.rolling import Seed
from shadow.engine.summary import LogHistogram, percentile
from shadow.engine.windows import Windows, lane_figures
from shadow.live.confidence import comparison, host_warnings, trust_problems
from shadow.live.routerrule import router_rule
from shadow.live.stepcheck import StepCheck
from shadow.live.stepfit import STEP_BUCKETS, StepEstimator
from shadow.live.workerclock import (
    COUNTLESS_UNIDENTIFIED,
    StepCounts,
    WorkerClock,
    WorkerModel,
    describe_costs,
    group_name,
)

DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
DEFAULT_POLICIES = ("jsq-bytes", "br0", "brh:survival")
RECENT_WINDOWS = 30  # per lane in the report's `windows`
COST_METHOD = (
    "per barrier group (per worker without one), from an engine probe's steps: their real period "
    "(the engine's time since its previous step) and, where the probe measures it (Linux schedstat), "
    "the engine's wait for a CPU, against the sequences computed n, the mirrored KV load L and the "
    "prefill tokens P; window means of window_steps consecutive steps; the engine's work of a window is "
    "its period less its wait's share of the engine's time (of a group: its members' largest), the host "
    "factor its period over that work; the cost is fitted on the engine's work (basis engine; on the "
    "period where no wait is measured: basis period): candidate forms b with any of c·n, a·L, p·P, each "
    "fitted by least squares (terms with 95% t-intervals); the form is the simplest whose time-blocked "
    "cross-validated error (10 blocks; median absolute relative error on window means) the best form "
    "does not beat beyond noise (95% t-interval of the per-block log ratios of their errors above 0), "
    "never one with a "
    "significantly negative term; the lanes step on the cost × the host factor of the last host_windows "
    "windows, and period_error is how far that was off each window's mean period when it closed (median)")


class _ActualLane(Observer):
    """What the `actual` lane does, for the fidelity check (its steps) and agreement (its offers)."""

    def __init__(self, lanes: LiveLanes) -> None:
        self.lanes = lanes

    def offering(self, lane: Lane, job: Job) -> None:
        self.lanes._on_offer(lane, job)

    def stepped(self, lane: Lane) -> None:
        self.lanes._on_step(lane)


def _load_average() -> float | None:
    """The host's 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(x, nd)


def step_period(ev: Step) -> float | None:
    """The engine's real step period of a step event: its own time since its previous step, else
    the probe's interval between busy steps; None when it has neither (`duration_s` of an engine
    probe is the engine's elapsed execute time, which leaves out the forward pass on vLLM's CPU
    executor: 70-90 % of the period, bench/vllm_step_period.py)."""
    for x in (ev.engine_interval_s, ev.interval_s):
        if x is not None and x > 0:
            return x
    return None


def step_counts(ev: Step) -> StepCounts | None:
    """What the engine scheduled into the step (`StepCounts`), from its probe's fields: the
    sequences it computed (decode + prefill requests; the running count after it from older
    probes) and its prefill tokens (0 when not reported), with the engine's cumulative wait for a
    CPU and time on one, and its step index; a DP rank's padding step computed none. None without a
    running count."""
    if ev.dummy:
        seqs, prefill = 0, 0
    elif ev.decode_requests is not None:
        seqs, prefill = ev.decode_requests + (ev.prefill_requests or 0), ev.prefill_tokens or 0
    elif ev.running is not None:
        seqs, prefill = ev.running, ev.prefill_tokens or 0
    else:
        return None
    return StepCounts(seqs, prefill, ev.engine_wait_s, ev.iteration, ev.engine_run_s)


def window_fields(last: WindowFigures | None) -> LastWindow:
    """A lane's last complete window (rolling: from its seed; None: none yet), beside its
    cumulative figures."""
    if last is None:
        return {"window_index": None, "window_avg_spread_tokens": None, "window_avg_imbalance_tokens": None,
                "window_barrier_idle_fraction": None, "window_throughput_tokens_per_s": None}
    return {
        "window_index": last["index"],
        "window_avg_spread_tokens": last["avg_spread_tokens"],
        "window_avg_imbalance_tokens": last["avg_imbalance_tokens"],
        "window_barrier_idle_fraction": last["barrier_idle_fraction"],
        "window_throughput_tokens_per_s": last["throughput_tokens_per_s"],
    }


class LiveLanes:
    """The live lanes of `shadow serve`, off the relay loop.

    `listener(event)` is what the mirror calls for every applied event, on the relay loop:
    it only appends to a bounded deque (full → the event is dropped and counted as `queue_full`;
    the relay never waits). A daemon thread drains the deque into a `LiveDriver`, leaves out the
    worker-reported steps the mirror's streams refute (`StepCheck`), closes step-time windows
    (`StepEstimator` → `SlidingFit`), compares the `actual` lane with the mirrored loads
    (fidelity), counts agreement between the router and each policy, advances the lanes to the live
    clock, and publishes an immutable snapshot (`report()`, `metric_values()`) — readers never
    touch lane state. Watermarks: `enqueued`, `processed`, `dropped_total`; `drain()` (blocking,
    call from a thread) processes everything queued and runs the lanes as far as known ends allow.

    The live clock: the newest event time plus the wall time elapsed since it was processed (so a
    quiet fleet still moves forward); producers on one host share CLOCK_MONOTONIC.
    """

    def __init__(
        self,
        *,
        workers: Sequence[str],
        slots: int,
        policies: Sequence[str] = DEFAULT_POLICIES,
        lag_s: float = 2.0,
        step: StepTimeModel | None = None,
        step_source: str = "auto",
        lane_clock: str = "measured",
        br: BRParams | None = None,
        seed: int = 0,
        queue_size: int = 200_000,
        tick_s: float = 0.05,
        publish_s: float = 0.25,
        window_s: float = 0.5,
        fit_window: int = 600,
        compare_window_s: float = 60.0,
        rolling_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not workers:
            raise ValueError("live lanes need at least one decode worker")
        if lane_clock not in ("measured", "configured"):
            raise ValueError(f"lane clock must be measured or configured, got {lane_clock!r}")
        self.measured_clock = lane_clock == "measured"
        if queue_size < 1:
            raise ValueError(f"queue size must be >= 1, got {queue_size}")
        self.workers = list(workers)
        self.slots = slots
        self.step = step or StepTimeModel()
        self.config = EngineConfig(
            workers=len(workers), slots=slots, step=self.step, br=br or BRParams(), seed=seed
        )
        self.specs = [LaneSpec.parse(p) for p in policies]
        self.seed_sink: Callable[[Seed], None] | None = None  # told every seed taken (a recorder)
        self.driver = LiveDriver(self.config, self.specs, self.workers, time.perf_counter, lag_s=lag_s,
                                 rolling_s=rolling_s)
        # lane figures per window; rolling: the windows are the re-seeded ones
        self.rolling_s = self.driver.rolling_s
        self.windows = Windows(self.driver.lanes, self.rolling_s or compare_window_s)
        self.driver.observe(self.windows)
        self._comparison_key: tuple[int, tuple[str, ...]] | None = None  # what it was computed for
        self._comparison: Comparison  # set by the first _publish
        self.clock = clock
        self.queue_size = queue_size
        self.tick_s = tick_s
        self.publish_s = publish_s
        self._queue: deque[Event] = deque()
        self._step_events: list[Step] = []  # the applied step events, in the driver's `steps` order
        self.enqueued = 0
        self.processed = 0
        self.dropped: dict[str, int] = {"queue_full": 0, "error": 0}
        self.estimator = StepEstimator(window_s=window_s, source=step_source)
        self.fit = SlidingFit(fit_window)
        # the lanes' clock: per-worker step models and barrier groups from the measured steps
        self.worker_clock = WorkerClock(len(workers), self.step, fit_window=fit_window)
        # worker-reported steps the mirror's streams (or the configured model) cannot vouch for
        self.step_check = StepCheck(len(workers), self.step)
        self.lane_clock, self._worker_models = self.worker_clock.clock(None)
        if self.measured_clock:
            self.driver.set_clock(self.lane_clock)
        self.step_hist: dict[str, list[int]] = {s: [0] * (len(STEP_BUCKETS) + 1) for s in ("events", "sse")}
        self.step_sum: dict[str, float] = {"events": 0.0, "sse": 0.0}
        self.step_count: dict[str, int] = {"events": 0, "sse": 0}
        # Σ w·measured, Σ w·configured-model step time over the windows, w = the steps a window
        # holds (its step count; window / mean for SSE): the same per-step mean the report gives
        self._model_check = [0.0, 0.0]
        self._window_steps = 0  # worker-reported steps in the current window
        self._both = [0.0, 0, 0.0]  # windows with both sources: Σ reported, steps, Σ SSE estimate (per step)
        self._inv_sum = 0.0  # Σ 1/T over SSE windows: their step-weighted mean is count / Σ 1/T
        self._x_sum = 0.0  # max mirrored load summed over the observations of the current window
        self._x_n = 0
        # fidelity: mirrored loads at window ends, compared when the actual lane passes them
        # (window start, end, mean placed load per worker) of the mirror, compared with the actual
        # lane's mean over its steps in the same window (averaging both sides over a window takes
        # out the phase between the lane's step boundaries and the fleet's)
        self._mirror_ring: deque[tuple[float, float, list[float]]] = deque(maxlen=10_000)
        self._mw_sum = [0.0] * len(workers)
        self._mw_n = 0
        self._mw_start: float | None = None
        self._lw_sum = [0.0] * len(workers)
        self._lw_n = 0
        self.fidelity_sum = 0.0  # Σ per-snapshot relative error
        self.fidelity_n = 0
        self.fidelity_abs = 0.0  # Σ_snapshots Σ_g |lane − mirror|
        self.fidelity_tot = 0.0  # Σ_snapshots Σ_g mirror
        self.fidelity_recent: deque[float] = deque(maxlen=120)
        # agreement: what each policy would have chosen in the router's place
        self._agree: dict[str, Router] = {}
        for spec in self.specs:
            if spec.policy != "brh":  # BR-H's choice needs its own predictor state: not compared
                options = RouterOptions(br=self.config.br, seed=seed, view_age_s=spec.view_age_s)
                self._agree[spec.label] = make_router(spec.policy, options)
        self.agreements: dict[str, int] = dict.fromkeys(self._agree, 0)
        self.decisions: dict[str, int] = dict.fromkeys(self._agree, 0)
        # each rule is asked on the router's own view at the placement (its ledger and the mirror's
        # running requests), not on the actual lane's modelled fleet
        self._views = self.driver.watch_router() if self._agree else None
        self.driver.observe(_ActualLane(self), ACTUAL)
        self._snapshot: Report
        self._last_event_wall = clock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._drain_req = 0
        self._drain_done = 0
        self._lock = threading.Lock()  # serialises the worker thread with drain()/process_now()
        self._thread: threading.Thread | None = None
        self.busy_s = 0.0  # CPU seconds the worker thread spent (thread_time)
        # told what moves the lanes, in order — ("batch", the events one `process_now` applied),
        # ("advance", t), ("drain", None) — so lane shards replay it (`shadow.live.shards`)
        self.tee: Callable[[str, Any], None] | None = None
        self._publish()

    # -- relay side ---------------------------------------------------------------------------

    def listener(self, ev: Event) -> None:
        """Mirror listener: O(1), never blocks, never raises."""
        if len(self._queue) >= self.queue_size:
            self.dropped["queue_full"] += 1
            return
        self._queue.append(ev)
        self.enqueued += 1

    @property
    def dropped_total(self) -> int:
        return self.dropped["queue_full"]

    # -- worker side --------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shadow-live-lanes", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def _run(self) -> None:
        last_publish = 0.0
        t_cpu = time.thread_time()
        while not self._stop.is_set():
            with self._lock:
                self.process_now()
                self.advance_to(self.live_now())
                wall = self.clock()
                if wall - last_publish >= self.publish_s:
                    self._publish()
                    last_publish = wall
            now_cpu = time.thread_time()
            self.busy_s += now_cpu - t_cpu
            t_cpu = now_cpu
            self._wake.wait(self.tick_s)
            self._wake.clear()

    def live_now(self) -> float:
        """The newest event time plus the wall time since it was processed."""
        return self.driver.now + max(0.0, self.clock() - self._last_event_wall)

    def advance_to(self, t: float) -> None:
        """Run the lanes up to event time `t` (less the lag), as far as known ends allow."""
        self.driver.advance_to(t)
        if self.tee is not None:
            self.tee("advance", t)

    def process_now(self, limit: int = 1_000_000) -> int:
        """Apply up to `limit` queued events (worker thread, or tests without the thread)."""
        q, d = self._queue, self.driver
        n = 0
        before = d.now
        taken: list[Event] | None = [] if self.tee is not None else None
        while q and n < limit:
            ev = q.popleft()
            if taken is not None:
                taken.append(ev)
            try:
                d.apply(ev)
            except Exception:
                self.dropped["error"] += 1
            else:
                if isinstance(ev, Step):
                    self._step_events.append(ev)
            n += 1
            if n % 512 == 0:
                self._observe()
        self.processed += n
        if taken and self.tee is not None:
            self.tee("batch", taken)
        if d.seeds.new:
            seeds, d.seeds.new = d.seeds.new, []
            if self.seed_sink is not None:
                for seed in seeds:
                    self.seed_sink(seed)
        if n:
            self._observe()
            if d.now > before:
                self._last_event_wall = self.clock()
        return n

    def _observe(self) -> None:
        d = self.driver
        est = self.estimator
        self._x_sum += max(d.mirror_loads)
        self._x_n += 1
        if self._mw_start is None:
            self._mw_start = d.now
        self._mw_sum = list(map(operator.add, self._mw_sum, d.mirror_placed))
        self._mw_n += 1
        wc = self.worker_clock
        wc.add_loads(d.mirror_loads)
        ends, d.worker_gap_ends = d.worker_gap_ends, []
        if ends:  # before the steps: a step is judged on the streams seen up to and after it
            self.step_check.saw(ends)
            if est.source != "events":
                wc.add_ends(ends)
        if d.steps:
            events, self._step_events = self._step_events, []
            self._take_steps(d.steps, events if len(events) == len(d.steps) else None)
            d.steps = []
        if est.due(d.now):
            # the window's token gaps (they wait in the driver until its end), converted once
            gaps = [np.asarray(xs, dtype=np.float64) for xs in d.take_gaps()]
            for part in gaps:
                est.add_gaps(part)
            if est.source != "events":
                wc.add_gaps(gaps[:-1])
            sample = est.close(d.now)
            if self._mw_start is not None:
                n = self._mw_n
                self._mirror_ring.append((self._mw_start, d.now, [x / n for x in self._mw_sum]))
            self._mw_sum = [0.0] * len(self._mw_sum)
            self._mw_n = 0
            self._mw_start = d.now
            x = self._x_sum / self._x_n
            self._x_sum, self._x_n = 0.0, 0
            steps, self._window_steps = self._window_steps, 0
            if sample is not None and sample[0] == "events" and est.sse_aside is not None:
                # the same window both ways: worker-reported (probe) steps and SSE gaps, per step
                self._both[0] += sample[1] * steps
                self._both[1] += steps
                self._both[2] += steps * est.sse_aside
            if sample is not None:
                source, mean_step, robust_step = sample
                if source == "sse":
                    self._hist("sse", mean_step)
                    self._inv_sum += 1.0 / mean_step
                w = steps if source == "events" else 1.0 / mean_step
                self.fit.add(x, robust_step)
                self._model_check[0] += w * mean_step
                self._model_check[1] += w * self.step.step_time(x)
            wc.close(self.lane_clock)
            self._set_clock()

    def _take_steps(self, steps: list[tuple[int, float, float, float, str | None]],
                    events: list[Step] | None) -> None:
        """Worker-reported steps: the plausible ones (`StepCheck`) to the estimate and the clock,
        the others counted by reason. A step's measure is the engine's real step period when its
        event has one (`step_period`), else its duration; with the engine's counts (`events`, in
        the same order) it also feeds the cost fits."""
        check, wc, loads = self.step_check, self.worker_clock, self.driver.mirror_loads
        to_clock = self.estimator.source != "sse"
        durations: list[float] = []
        for i, (g, t, duration, period, source) in enumerate(steps):
            if check.check(None if g < 0 else g, t, duration, period, loads) is not None:
                continue
            ev = events[i] if events is not None else None
            real = step_period(ev) if ev is not None else None
            durations.append(duration if real is None else real)
            if g >= 0 and to_clock:
                counts = step_counts(ev) if ev is not None and real is not None else None
                wc.add_step(g, t, period if real is None else real, source, counts, loads)
        self.estimator.add_steps(durations)
        self._window_steps += len(durations)
        for x in durations:
            self._hist("events", x)

    def _fleet_model(self) -> StepTimeModel | None:
        """Under a fleet-wide barrier: the fleet's fit when good, else its robust per-step mean
        over the recent windows (`StepEstimator.robust`)."""
        fit = self.fit.result()
        model = fit.model(self.step)
        if model is not self.step:
            return model
        robust = self.estimator.robust
        mean = robust.mean()
        return StepTimeModel(0.0, mean) if mean is not None and len(robust) >= 4 else None

    def _set_clock(self) -> None:
        """Step the lanes on the clock the measured steps give (see `shadow.live.workerclock`);
        with the configured clock, only describe it."""
        clock, self._worker_models = self.worker_clock.clock(self._fleet_model())
        if self.measured_clock and clock != self.lane_clock:
            self.lane_clock = clock
            self.driver.set_clock(clock)

    def _hist(self, source: str, x: float) -> None:
        h = self.step_hist[source]
        i = 0
        while i < len(STEP_BUCKETS) and x > STEP_BUCKETS[i]:
            i += 1
        h[i] += 1
        self.step_sum[source] += x
        self.step_count[source] += 1

    def _on_step(self, lane: Lane) -> None:
        if self.driver.origin is None:
            return
        ring = self._mirror_ring
        t_event = lane.now + self.driver.origin
        while ring and ring[0][1] <= t_event:
            _, _, mirror = ring.popleft()
            n, self._lw_n = self._lw_n, 0
            lane_mean = [x / n for x in self._lw_sum] if n else None
            self._lw_sum = [0.0] * len(self._lw_sum)
            total = sum(mirror)
            if lane_mean is None or total <= 0:
                continue
            diff = sum(abs(a - b) for a, b in zip(lane_mean, mirror, strict=True))
            err = diff / total
            self.fidelity_abs += diff
            self.fidelity_tot += total
            self.fidelity_sum += err
            self.fidelity_n += 1
            self.fidelity_recent.append(err)
        if ring and ring[0][0] <= t_event:
            # placed load on both sides: running KV + prompts queued at the worker (+ the lane's
            # requests whose streams have not ended yet: `Lane.placed_loads`)
            for g, x in enumerate(lane.placed_loads()):
                self._lw_sum[g] += x
            self._lw_n += 1

    def _on_offer(self, lane: Lane, job: Job) -> None:
        if not self._agree:
            return
        actual = self.driver.assignment(job.request_id)
        view = None if self._views is None else self._views.take(job.request_id)
        fleet = lane.snapshot()
        if view is not None:  # else a request the lanes know only from a seed: the lane's model
            fleet = view.snapshot(self.config.slots, fleet.cost, fleet.extras)
        for label, router in self._agree.items():
            router.on_arrive(job.request_id, job.prompt_tokens, lane.now)
            picks = router.decide(fleet, lane.now)
            if isinstance(router, PoolRouter):
                router.pool = Pool()  # one question per request: nothing waits in this copy
            if picks:
                self.decisions[label] += 1
                if picks[0][1] == actual:
                    self.agreements[label] += 1

    def drain(self, timeout_s: float = 60.0) -> None:
        """Process everything queued and run the lanes as far as known ends allow (blocking)."""
        if not self._lock.acquire(timeout=timeout_s):
            raise TimeoutError("live lanes busy")
        try:
            self.process_now()
            self.driver.drain()
            if self.tee is not None:
                self.tee("drain", None)
            self._publish()
        finally:
            self._lock.release()

    # -- snapshot -----------------------------------------------------------------------------

    def report(self) -> Report:
        """The latest published report (`shadow.contracts.report.Report`)."""
        return self._snapshot

    def _step_means(self) -> dict[str, float | None]:
        """Mean step time per source: worker-reported steps averaged; SSE windows (equal length,
        one median each) weighted by the steps they hold (harmonic mean)."""
        n = self.step_count["events"]
        return {"events": self.step_sum["events"] / n if n else None,
                "sse": self.step_count["sse"] / self._inv_sum if self._inv_sum > 0 else None}

    def _measured_mean(self) -> float | None:
        """The mean the fit's windows came from (events when any window had them, else SSE)."""
        means = self._step_means()
        return means["events"] if self.estimator.samples["events"] else means["sse"]

    def _sse_check(self) -> dict[str, Any]:
        """The SSE-gap estimate against the worker-reported (probe) steps of the same windows:
        trusted within 10 %; otherwise, or without reported steps to check it, the reason."""
        reported, steps, sse = self._both
        if not steps:
            return {"trusted": None, "reason": "no worker-reported steps beside SSE gaps to check them "
                    "against (a merged chunk counts as one step)"}
        ratio = sse / reported if reported > 0 else None
        out: dict[str, Any] = {"sse_mean_s": sse / steps, "reported_mean_s": reported / steps,
                               "ratio": ratio, "steps": steps}
        if ratio is not None and abs(ratio - 1.0) <= 0.10:
            return {**out, "trusted": True, "reason": "within 10 % of the reported steps"}
        why = ("SSE gaps are longer than the engine's steps: the engine merges several tokens into "
               "one chunk when the HTTP side lags, and the streams' pauses are not steps"
               if ratio is not None and ratio > 1 else
               "SSE gaps are shorter than the engine's reported steps (the reported time covers more "
               "than the gap between two chunks)")
        return {**out, "trusted": False, "reason": f"{why}: {100 * ((ratio or 0) - 1):+.0f}% off"}

    def _samples_from(self) -> str | None:
        """Where the fit's samples came from, in words: the engine probe, step events, SSE gaps."""
        by = self.estimator.samples
        if by["events"]:
            sources = self.driver.step_sources
            src = max(sources, key=sources.__getitem__) if sources else ""
            what = {"probe": "the engine probe (the engine's own step times)",
                    "probe_interval": "the engine probe (intervals between busy steps)"}.get(
                        src, "step events")
            return what if not by["sse"] else f"{what} and SSE inter-chunk gaps"
        return "SSE inter-chunk gaps" if by["sse"] else None

    def _clock_view(self) -> tuple[str, str, FitResult, list[tuple[str, WorkerModel]]]:
        """The clock in use: its model in words, its samples' source (probe / sse / configured /
        events, '+' joined when workers differ), the fit it stands on (fleet-wide under one barrier;
        else the worst worker's), and the workers whose linear fit does not hold."""
        per = self._worker_models
        choice = self.worker_clock.choice
        fleet = self.fit.result()
        if not self.measured_clock:
            return "fleet-wide barrier (--lane-clock configured)", "configured", fleet, []
        sources = sorted({m.source for m in per})
        if choice.groups is not None and len(choice.groups) == 1:
            return "fleet-wide barrier", "+".join(sorted(set(sources) - {"configured"}) or sources), fleet, []
        poor = [(self.workers[g], m) for g, m in enumerate(per)
                if m.fit.quality == "poor" and m.kind != "cost fit"]
        rank = {"poor": 0, "insufficient": 1, "good": 2}
        worst = min((m.fit for m in per), key=lambda f: (rank[f.quality], f.r2 if f.r2 is not None else -1.0))
        if choice.groups is None:
            what = "fleet-wide barrier (undecided: " + choice.reason + ")"
            return what, "+".join(sources), worst if any(m.kind != "configured" for m in per) else fleet, poor
        return choice.model, "+".join(sources), worst, poor

    def _publish(self) -> None:
        """Build the report (`shadow.contracts.report.Report`) from the lanes' state now."""
        d = self.driver
        fit = self.fit.result()
        g = len(self.workers)
        clock_model, clock_source, clock_fit, poor = self._clock_view()
        lanes: dict[str, LaneReport] = {}
        recent: dict[str, list[WindowFigures]] = {}
        for lane in d.lanes:
            label = lane.spec.label
            recent[label] = [w.figures(None, g) for w in self.windows.recent(label, RECENT_WINDOWS)]
            lanes[label] = {**lane_figures(lane.totals, None, g),  # on the lanes' own (measured) clock
                            **window_fields(recent[label][-1] if recent[label] else None),
                            **self._lane_state(lane)}
        on_configured = clock_source == "configured"
        measured, modelled = self._model_check
        vs_clock = self.worker_clock.measured_vs_clock()
        fidelity = self._fidelity()
        fid = fidelity["load_rel_error"]
        drift = (measured / modelled if modelled > 0 else None) if on_configured else vs_clock
        cost_fits = self.worker_clock.cost_fits()
        named = [(group_name(self.workers, grp), cf) for grp, cf in cost_fits]
        problems = trust_problems(clock_fit, fid, drift, self.dropped_total, named)
        warnings = self._warnings(fit, clock_model, on_configured, poor)
        warnings += host_warnings(named, not problems)
        key = (self.windows.complete, tuple(problems))
        if self._comparison_key != key:
            self._comparison_key, self._comparison = key, comparison(self.windows, None, g, problems)
        step_model = self._step_model(fit, (clock_model, clock_source, clock_fit), bool(poor), cost_fits)
        self._snapshot = {
            "lanes": lanes,
            # which compared lane's rule is closest to the real router's placements
            "router_rule": router_rule(lanes),
            "step_model": step_model,
            "fidelity": fidelity,
            "workers": list(self.workers),
            "slots": self.slots,
            "lag_s": d.lag_s,
            "mirrored": {
                "worker_loads": dict(zip(self.workers, d.mirror_loads, strict=True)),
                "worker_placed_loads": dict(zip(self.workers, d.mirror_placed, strict=True)),
                "worker_active": dict(zip(self.workers, d.mirror_active, strict=True)),
            },
            "events": {
                "enqueued": self.enqueued,
                "processed": self.processed,
                "dropped": dict(self.dropped),
                "queue_depth": len(self._queue),
                "queue_capacity": self.queue_size,
            },
            "requests": {
                "released": d.released,
                "open": d.open_requests(),
                "late": d.late,
                "dropped": dict(d.dropped),
                "unknown_worker_routes": d.unknown_worker,
            },
            "step_histogram": {
                s: {"buckets": list(STEP_BUCKETS), "counts": list(h), "sum": self.step_sum[s]}
                for s, h in self.step_hist.items()
            },
            "cpu_s": self.busy_s,
            "warnings": warnings,
            "comparison": self._comparison,
            "rolling": self._rolling(),
            "windows": {"window_s": self.windows.window_s, "lanes": recent},
        }

    def _step_model(self, fit: FitResult, clock: tuple[str, str, FitResult], poor: bool,
                    cost_fits: list[tuple[tuple[int, ...], CostFit]]) -> StepModelReport:
        """The report's `step_model`: the fleet-wide fit, the clock in use (`_clock_view`: its model
        in words, its samples' source, the fit it stands on; `poor`: some worker's linear fit does
        not hold) and the step-cost model of each barrier group."""
        clock_model, clock_source, clock_fit = clock
        on_configured = clock_source == "configured"
        measured, modelled = self._model_check
        vs_clock = self.worker_clock.measured_vs_clock()
        return {
            "a_s_per_token": fit.a_s_per_token,
            "b_s": fit.b_s,
            "r2": fit.r2,
            "samples": fit.samples,
            "quality": fit.quality,
            "max_load_range_tokens": [fit.x_min, fit.x_max],
            "source": self.estimator.source,
            "samples_by_source": dict(self.estimator.samples),
            "samples_from": self._samples_from(),
            "step_event_sources": dict(self.driver.step_sources),
            # step events the lanes left out, by reason (`shadow.live.stepcheck`)
            "step_events_rejected": dict(self.step_check.rejected),
            "configured": {"a_s_per_token": self.step.a, "b_s": self.step.b},
            # the clock the lanes step on: its model, where its samples came from
            "model_in_use": clock_model,
            "model_source": clock_source,
            "figures_use": "configured" if on_configured else "measured",
            # False: enough samples, and the model in use (a·max L + b fleet-wide, a_g·L_g + b_g
            # per worker) does not explain them (see the warning)
            "linear_model_holds": False if poor else {"good": True, "poor": False}.get(clock_fit.quality),
            "clock": {
                **self.worker_clock.describe(self.workers, self._worker_models),
                # what each worker's lane steps on now (under one barrier: the fleet's model)
                "lane_models": {
                    name: {"a_s_per_token": m.a, "b_s": m.b, "c_s_per_seq": m.c, "p_s_per_token": m.p}
                    for name, m in zip(self.workers, self.lane_clock.models or (), strict=False)
                },
            },
            # the step-cost model of each barrier group (`shadow.core.stepcost`), from an engine
            # probe's counts; SSE gaps alone cannot identify some terms
            "cost": {
                "method": COST_METHOD,
                "window_steps": self.worker_clock.window_steps,
                "oos_error_max": OOS_ERROR_MAX,
                "period_error_max": PERIOD_ERROR_MAX,
                "host_windows": HOST_WINDOWS,
                "groups": describe_costs(self.workers, cost_fits),
                # without an engine probe's counts: what the estimator cannot identify
                "not_identifiable": None if cost_fits else dict(COUNTLESS_UNIDENTIFIED),
            },
            "host_load_average": _load_average(),
            "measured_vs_configured": (measured / modelled) if modelled > 0 else None,
            "measured_vs_clock": vs_clock,
            # per step: worker-reported steps averaged; SSE windows (equal length, one median
            # each) weighted by the steps they hold (harmonic mean)
            "measured_step_mean_s": self._step_means(),
            "sse_check": self._sse_check(),
        }

    def _lane_state(self, lane: Lane) -> LaneState:
        """What `lane` holds now and how its decisions went (beside its figures in the report)."""
        t, loads, queued, label = lane.totals, lane.loads, lane.queued_tokens, lane.spec.label
        dec = t.decision_s
        return {
            "policy": lane.spec.policy,
            "spread_tokens": max(loads) - min(loads),
            "imbalance_tokens": len(loads) * max(loads) - sum(loads),
            "lookahead_stalls": t.stalls,
            "reseeds": lane.reseeds,
            # rolling: requests a re-seed took out before they finished here (reality ended them)
            "requests_dropped": lane.dropped_unfinished,
            "windows_cut": self.driver.cuts.get(label, 0),
            "lag_s": self.driver.lag(lane),
            "waiting": lane.waiting,
            "worker_loads": {w: loads[i] + queued[i] for i, w in enumerate(self.workers)},
            "worker_running_loads": {w: loads[i] for i, w in enumerate(self.workers)},
            "worker_active": {w: lane.running[i] for i, w in enumerate(self.workers)},
            "agreements": self.agreements.get(label),
            "decisions": self.decisions.get(label),
            "agreement_rate": self.agreements[label] / self.decisions[label]
            if self.decisions.get(label) else None,
            "decision_ms_p50": percentile(dec, 50, 1e3),
            "decision_ms_p99": percentile(dec, 99, 1e3),
            "decision_buckets": dec.cumulative(DECISION_BUCKETS) if isinstance(dec, LogHistogram) else [],
            "decision_count": len(dec),
            "decision_sum_s": dec.total if isinstance(dec, LogHistogram) else 0.0,
        }

    def _warnings(self, fit: FitResult, clock_model: str, on_configured: bool,
                  poor: list[tuple[str, WorkerModel]]) -> list[str]:
        """What an operator must know before reading the figures: the step model and the clock."""
        warnings: list[str] = []
        fleet_wide = clock_model.startswith("fleet-wide")
        on_cost = self.measured_clock and any(m.kind == "cost fit" for m in self._worker_models)
        uses = (f"the lanes step on the configured model a={self.step.a:g} s/token, b={self.step.b:g} s"
                if on_configured else "the lanes step on the measured mean step")
        if on_cost:
            pass  # the step-cost model is the clock: its own checks (trust_problems)
        elif fleet_wide and fit.quality == "poor":
            warnings.append(
                f"the linear step model T = a·max L + b does not hold for these workers (R²={_r(fit.r2, 3)} "
                f"over {fit.samples} samples from {self._samples_from()}): {uses}, which does not follow "
                "the load"
            )
        elif fleet_wide and fit.quality != "good":
            warnings.append(
                f"step model fit is {fit.quality} (R²={_r(fit.r2, 3)}, {fit.samples} samples): {uses}"
            )
        if poor:
            names = ", ".join(
                f"{name} (R²={_r(m.fit.r2, 3)} over {m.fit.samples} samples from "
                f"{'the engine probe' if m.source == 'probe' else m.source}; mean step "
                f"{1e3 * (m.mean_step_s or 0.0):.2f} ms)" for name, m in poor)
            warnings.append(
                f"the linear step model τ = a·L + b does not hold per worker for {names}: "
                f"{'their lanes step' if len(poor) > 1 else 'its lane steps'} on the measured mean step, "
                "which does not follow the load"
            )
        measured, modelled = self._model_check
        mean_step = self._measured_mean()
        if on_configured and modelled > 0 and abs(measured / modelled - 1.0) > 0.05:
            ms = f" (mean {1e3 * mean_step:.2f} ms per step)" if mean_step is not None else ""
            warnings.append(
                f"measured steps{ms} are {100 * (measured / modelled - 1):+.0f}% against the configured "
                "model the lanes simulate: lanes drift from the fleet's real timing (set --step-a/--step-b "
                "from the fit)"
            )
        if self.dropped_total:
            warnings.append(f"{self.dropped_total} events dropped (lanes overloaded): lanes miss requests")
        return warnings

    def _fidelity(self) -> FidelityReport:
        """The twin check. Load-weighted: Σ|lane − mirror| / Σ mirror over all snapshots and workers
        (a near-empty fleet's snapshot weighs as little as its load; the unweighted mean beside it);
        against the engines' own KV where their probe reports it (`shadow.engine.twincheck`: the
        mirror sees the HTTP side, whose delays no engine model predicts request by request)."""
        d = self.driver
        fid_mirror = self.fidelity_abs / self.fidelity_tot if self.fidelity_tot > 0 else None
        twin = None if d.twin is None else d.twin.figures()
        fid_engine = None if twin is None else twin["kv_vs_engine"]
        recent = self.fidelity_recent
        return {
            "load_rel_error": fid_engine if fid_engine is not None else fid_mirror,
            "reference": "engine" if fid_engine is not None else "mirror",
            "load_rel_error_mirror": fid_mirror,
            "load_rel_error_unweighted": self.fidelity_sum / self.fidelity_n if self.fidelity_n else None,
            "load_rel_error_recent": sum(recent) / len(recent) if recent else None,
            "samples": self.fidelity_n,
            # time averages per window, against the mirror and the engines' own steps, and what the
            # twin measured of the servers
            "twin": twin,
            "servers": None if d.servers is None else d.servers.describe(self.workers),
        }

    def _rolling(self) -> RollingReport:
        d = self.driver
        return {
            "window_s": self.rolling_s,
            "max_lag_s": d.max_lag_s,
            "windows_complete": self.windows.complete,
            "reseeds": d.reseeds,
            "seed_unknown_worker": d.seed_unknown_worker,
            "meaning": "every lane re-seeded from the mirrored fleet at each boundary of "
            f"{self.rolling_s:g} s: a window's figures say what each policy would have done from "
            "the same starting state; cumulative figures sum the windows"
            if self.rolling_s is not None else
            "off: each lane runs on from its own state since the start (lag can grow under overload)",
        }
