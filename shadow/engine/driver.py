"""The one loop that drives a lane: jobs offered at their ready times, steps in between, observers told.

At each step boundary, after the jobs due there are offered: waiting requests past the admission
timeout are shed, observers are told a step is about to be tried, and the lane stops if its clock
reached `stop_at`; then one step runs (`checked_step`) and observers are told it ran. An idle lane
jumps to the next ready time. With a rolling window W, `on_boundary(lane, n)` is called once per
boundary n·W (n >= 1, in order) as the lane's clock reaches it: after the step that crossed it
(observers told), or on an idle jump over it, which stops there. The offline drivers, the live
driver and the measurement protocol all drive lanes through it and only observe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shadow.engine.jobs import Job
from shadow.engine.lane import Lane, checked_step


class Observer:
    """Told what a driven lane does; every hook is optional (the base does nothing)."""

    def offering(self, lane: Lane, job: Job) -> None:
        """`job` is about to be offered to `lane` (at the lane's clock, its ready time reached)."""

    def stepping(self, lane: Lane) -> None:
        """A step of `lane` is about to be tried (this boundary's offers and sheds are done)."""

    def stepped(self, lane: Lane) -> None:
        """A step of `lane` ran."""

    def boundary(self, lane: Lane, n: int) -> None:
        """A rolling `lane` reached boundary n (lane time n·W): window n−1 is over (before any
        re-seed at n)."""

    def cut(self, lane: Lane, at: float) -> None:
        """`lane` left its current window unfinished: it jumps to the boundary at lane time `at`
        (a rolling lane too far behind, re-seeded there next)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """The overload model of a proxy: a bounded queue (arrivals refused while `queue_cap` requests
    wait) and an admission timeout (a request waiting longer than `timeout_s` is shed). Both count
    in `LaneTotals.shed`; None switches one off."""

    queue_cap: int | None = None
    timeout_s: float | None = None


class LaneDriver:
    """Drives one lane (see module docstring). `budget`: the step bound `checked_step` enforces;
    by default the output tokens of the jobs offered so far (the live driver passes its own)."""

    def __init__(
        self,
        lane: Lane,
        *,
        admission: Admission | None = None,
        observers: Sequence[Observer] = (),
        stop_at: float = math.inf,
        budget: Callable[[], float] | None = None,
        window_s: float | None = None,
        on_boundary: Callable[[Lane, int], None] | None = None,
    ) -> None:
        if (window_s is None) != (on_boundary is None):
            raise ValueError("a rolling window needs its boundary hook, and the hook its window")
        self.lane = lane
        self.window_s = window_s
        self.on_boundary = on_boundary
        self.next_boundary = 1  # the index of the next boundary (lane time next_boundary · W)
        self.admission = admission or Admission()
        self.observers = list(observers)
        self.stop_at = stop_at
        self.stopped = False
        self.offered = 0  # jobs the lane took (refused ones not counted)
        self.tokens = 0  # their output tokens
        self._budget = budget

    def budget(self) -> float:
        return self.tokens if self._budget is None else self._budget()

    def offer(self, job: Job, ready: float) -> bool:
        """Run the lane up to `ready`, then offer `job` (or refuse it: bounded queue; or skip it: a
        re-seed on the way put it in). False, and nothing offered, when the lane stopped or is held
        by an unknown end first."""
        lane = self.lane
        if not self.advance(ready):
            return False
        if job.request_id in lane.seeded:
            return True  # a re-seed on the way put it in the lane already
        cap = self.admission.queue_cap
        if cap is not None and lane.waiting >= cap:
            lane.refuse()
            return True
        for o in self.observers:
            o.offering(lane, job)
        lane.offer(job, ready)
        self.offered += 1
        self.tokens += job.output_tokens
        return True

    def advance(self, t: float) -> bool:
        """Step until the lane's clock reaches `t` (an idle lane, or one whose next step starts
        after `t`, jumps there). False when it stopped
        or is held (live: a running request's end not known yet). RuntimeError, naming the lane,
        for an idle lane whose `t` is not later than its clock (a NaN time)."""
        lane = self.lane
        if self.stopped:
            return False
        while not lane.now >= t:
            if not self._boundary():
                return False
            if self._step(t):
                continue
            if lane.stalled:
                return False
            if not t > lane.now:
                label = lane.spec.label
                raise RuntimeError(f"lane {label}: idle at t={lane.now} with a job ready at {t} not offered")
            at = self._boundary_at()
            if at <= t:
                lane.now = at
                self._roll()
            else:
                lane.now = t
        return True

    def _boundary_at(self) -> float:
        return math.inf if self.window_s is None else self.next_boundary * self.window_s

    def jump(self, n: int) -> list[int]:
        """Cut the lane's current window and take it to boundary `n` (> the next one's index is
        allowed): observers told `cut`, then the hook runs for boundary n. Returns the boundaries
        skipped on the way (their hook is not called)."""
        if self.window_s is None or n < self.next_boundary:
            return []
        skipped = list(range(self.next_boundary, n))
        for o in self.observers:
            o.cut(self.lane, n * self.window_s)
        self.next_boundary = n
        self.lane.now = max(self.lane.now, n * self.window_s)
        self._roll()
        return skipped

    def _roll(self) -> None:
        """The lane's clock reached the next boundary: tell the hook (it may re-seed the lane)."""
        assert self.on_boundary is not None
        n = self.next_boundary
        self.next_boundary += 1
        for o in self.observers:
            o.boundary(self.lane, n)
        self.on_boundary(self.lane, n)

    def run_out(self) -> None:
        """Step while steps run (until the lane is idle, held or stopped)."""
        while not self.stopped and self._boundary() and self._step():
            pass

    def drain(self, on_step: Callable[[Lane], None] | None = None) -> None:
        """Step until every job offered finished (offline, no admission rules); `on_step` after each
        step. RuntimeError when jobs are left but nothing runs (an engine bug)."""
        lane = self.lane
        while lane.totals.finished < self.offered:
            if not self._boundary():
                return
            if not self._step():
                raise RuntimeError(f"lane {lane.spec.label}: jobs left but nothing runs (engine bug)")
            if on_step is not None:
                on_step(lane)

    def _boundary(self) -> bool:
        lane = self.lane
        timeout = self.admission.timeout_s
        if timeout is not None:
            lane.shed_waiting(lane.now - timeout)
        if self.observers:
            for o in self.observers:
                o.stepping(lane)
        if lane.now >= self.stop_at:
            self.stopped = True
            return False
        return True

    def _step(self, until: float = math.inf) -> bool:
        lane = self.lane
        ran = checked_step(lane, self.tokens if self._budget is None else self._budget(), until)
        if ran and self.observers:
            for o in self.observers:
                o.stepped(lane)
        w = self.window_s
        if ran and w is not None and lane.now >= self.next_boundary * w:  # (= _boundary_at, inline)
            self._roll()
        return ran
