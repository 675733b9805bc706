"""Live lanes off the relay loop: a bounded event queue, one worker thread, published snapshots."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from shadow.contracts.events import Event, Step
from shadow.contracts.report import EventsReport, Report
from shadow.core.params import BRParams
from shadow.core.stepmodel import FIT_WINDOW, StepTimeModel
from shadow.engine.config import EngineConfig, LaneClock, LaneSpec
from shadow.engine.driver import Observer
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.engine.live import ACTUAL, LiveDriver
from shadow.engine.rolling import Seed
from shadow.engine.windows import Windows
from shadow.live.agreement import AgreementLedger
from shadow.live.config import LanesConfig
from shadow.live.fidelity import FidelityLedger
from shadow.live.reporting import (
    COST_METHOD,
    DECISION_BUCKETS,
    RECENT_WINDOWS,
    ReportBuilder,
    window_fields,
)
from shadow.live.stepcheck import StepCheck
from shadow.live.stepclock import StepClock, step_counts, step_period
from shadow.live.stepfit import StepEstimator
from shadow.live.workerclock import WorkerClock

__all__ = [
    "COST_METHOD",
    "DECISION_BUCKETS",
    "DEFAULT_POLICIES",
    "RECENT_WINDOWS",
    "LiveLanes",
    "step_counts",
    "step_period",
    "window_fields",
]

DEFAULT_POLICIES = ("jsq-bytes", "br0", "brh:survival")
#: Event-time spacing of the observation points: the mirrored loads are sampled (fidelity, the step
#: fit's x, the worker clocks' loads) and step windows may close when an event passes a multiple of
#: it, so the figures depend on the events and their times, not on how they were batched.
OBSERVE_S = 0.05


class _ActualLane(Observer):
    """What the `actual` lane does, for the fidelity check (its steps) and agreement (its offers)."""

    def __init__(self, driver: LiveDriver, fidelity: FidelityLedger, agreement: AgreementLedger) -> None:
        self.driver, self.fidelity, self.agreement = driver, fidelity, agreement

    def offering(self, lane: Lane, job: Job) -> None:
        self.agreement.offer(lane, job)

    def stepped(self, lane: Lane) -> None:
        origin = self.driver.origin
        if origin is not None:
            self.fidelity.lane_stepped(lane, origin)


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

    Its collaborators: the lanes' clock from the measured steps (`StepClock`), the fidelity check
    (`FidelityLedger`), the agreement ledger (`AgreementLedger`) and the report (`ReportBuilder`);
    this class keeps the intake queue, the worker thread, the live clock and the moves it tees.
    """

    def __init__(
        self,
        *,
        workers: Sequence[str],
        slots: int,
        policies: Sequence[str] = DEFAULT_POLICIES,
        lag_s: float = LanesConfig.lag_s,
        step: StepTimeModel | None = None,
        step_source: str = LanesConfig.step_source,
        lane_clock: str = LanesConfig.lane_clock,
        br: BRParams | None = None,
        seed: int = 0,
        queue_size: int = LanesConfig.live_queue_size,
        tick_s: float = 0.05,
        publish_s: float = 0.25,
        window_s: float = LanesConfig.step_window_s,
        fit_window: int = FIT_WINDOW,
        compare_window_s: float = LanesConfig.compare_window_s,
        rolling_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        token_interval_s: float = 0.0,
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
        # told of an exception a tick of the worker thread raised ("lanes"; shadow serve counts it in
        # shadow_mirror_errors_total and logs it); the thread goes on with the next tick
        self.on_error: Callable[[str], None] | None = None
        self.tick_errors = 0
        self.driver = LiveDriver(self.config, self.specs, self.workers, time.perf_counter, lag_s=lag_s,
                                 rolling_s=rolling_s)
        # Tokens held per interval (`--token-interval`): no steps are measured in the streams
        self.driver.table.stream_steps = token_interval_s == 0
        # lane figures per window; rolling: the windows are the re-seeded ones
        self.rolling_s = self.driver.rolling_s
        self.windows = Windows(self.driver.lanes, self.rolling_s or compare_window_s)
        self.driver.observe(self.windows)
        self.clock = clock
        self.queue_size = queue_size
        self.tick_s = tick_s
        self.publish_s = publish_s
        self._queue: deque[Event] = deque()
        self._next_observe = float("-inf")  # the next observation point (event time)
        self.enqueued = 0
        self.processed = 0
        self.dropped: dict[str, int] = {"queue_full": 0, "error": 0}
        self.steps = StepClock(len(workers), self.step, measured=self.measured_clock, source=step_source,
                               window_s=window_s, fit_window=fit_window, apply=self.driver.set_clock)
        self.fidelity = FidelityLedger(len(workers))
        # agreement: what each policy would have chosen in the router's place
        self.agreement = AgreementLedger(self.specs, self.config.br, seed, slots, self.driver.assignment,
                                         self.driver.watch_router)
        self.driver.observe(_ActualLane(self.driver, self.fidelity, self.agreement), ACTUAL)
        self.reports = ReportBuilder(self.workers, slots, self.step, self.driver, self.windows, self.steps,
                                     self.fidelity, self.agreement)
        self._snapshot: Report
        self._last_event_wall = clock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # serialises the worker thread with drain()/process_now()
        self._thread: threading.Thread | None = None
        self.busy_s = 0.0  # CPU seconds the worker thread spent (thread_time)
        # told what moves the lanes, in order — ("batch", the events one `process_now` applied),
        # ("observe", next point), ("advance", t), ("drain", None) — so lane shards replay it
        # (`shadow.live.shards`)
        self.tee: Callable[[str, Any], None] | None = None
        self._publish()

    # -- the lanes' clock (`StepClock`) ---------------------------------------------------------

    @property
    def lane_clock(self) -> LaneClock:
        """The clock the lanes step on (the configured clock: the one the measured steps give)."""
        return self.steps.lane_clock

    @lane_clock.setter
    def lane_clock(self, clock: LaneClock) -> None:
        self.steps.lane_clock = clock

    @property
    def estimator(self) -> StepEstimator:
        return self.steps.estimator

    @property
    def worker_clock(self) -> WorkerClock:
        return self.steps.worker_clock

    @property
    def step_check(self) -> StepCheck:
        return self.steps.check

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
            try:
                with self._lock:
                    self.process_now()
                    now = self.live_now()
                    if math.isfinite(now) and now >= self._next_observe:  # the input went quiet past a point
                        self.observe((math.floor(now / OBSERVE_S) + 1) * OBSERVE_S)
                    self.advance_to(now)
                    wall = self.clock()
                    if wall - last_publish >= self.publish_s:
                        self._publish()
                        last_publish = wall
            except Exception:  # counted and told; a thread that died would leave the report frozen, unsaid
                self.tick_errors += 1
                if self.on_error is not None:
                    self.on_error("lanes")
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
        apply, steps = d.table.apply, self.steps
        n = 0
        before = d.now
        taken: list[Event] | None = [] if self.tee is not None else None
        grid = self._next_observe
        while q and n < limit:
            ev = q.popleft()
            if taken is not None:
                taken.append(ev)
            t = ev.t
            if t >= grid:  # the event passes an observation point: observe what came before it
                self._observe()
                grid = self._next_observe = (math.floor(t / OBSERVE_S) + 1) * OBSERVE_S
            try:
                apply(ev)
            except Exception:
                self.dropped["error"] += 1
            else:
                if isinstance(ev, Step):
                    steps.events.append(ev)
            n += 1
        self.processed += n
        if taken and self.tee is not None:
            self.tee("batch", taken)
        if d.seeds.new:
            seeds, d.seeds.new = d.seeds.new, []
            if self.seed_sink is not None:
                for seed in seeds:
                    self.seed_sink(seed)
        if n and d.now > before:
            self._last_event_wall = self.clock()
        return n

    def observe(self, next_point: float | None = None) -> None:
        """An observation point between events: at the input's end (`drain`), or where the live clock
        passed the next point with no event passing it (the worker thread, when the input goes
        quiet); then the next point is `next_point` (None: unchanged). Teed, so that lane shards
        observe at the same place in the events."""
        self._observe()
        if next_point is not None:
            self._next_observe = next_point
        if self.tee is not None:
            self.tee("observe", next_point)

    def _observe(self) -> None:
        """What the events since the last call gathered: to the fidelity check's mirror window and
        the lanes' clock (whose step-time windows the mirror windows follow). Called at points of
        event time (`OBSERVE_S`), never at batch ends; before a window's close changes the lanes'
        clock, the lanes are run up to it, so their steps up to that point take the old clock."""
        table = self.driver.table
        if table.now == float("-inf"):
            return  # no event yet: nothing to observe
        self.fidelity.observe(table.now, table.mirror_placed)
        if self.steps.closes(table.now):
            self.driver.advance_to(table.now)  # (not teed: a shard does it where it replays the batch)
        if self.steps.observe(table):
            self.fidelity.close_window(table.now)

    def drain(self, timeout_s: float = 60.0) -> None:
        """Process everything queued and run the lanes as far as known ends allow (blocking)."""
        if not self._lock.acquire(timeout=timeout_s):
            raise TimeoutError("live lanes busy")
        try:
            self.process_now()
            self.observe()  # the end of the input: its last observation point
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

    def _publish(self) -> None:
        """Build the report (`ReportBuilder`) from the lanes' state now."""
        events: EventsReport = {
            "enqueued": self.enqueued,
            "processed": self.processed,
            "dropped": dict(self.dropped),
            "queue_depth": len(self._queue),
            "queue_capacity": self.queue_size,
        }
        self._snapshot = self.reports.build(events, self.dropped_total, self.busy_s)
