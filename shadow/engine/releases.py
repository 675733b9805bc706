"""The live driver's release sequence: requests waiting for their arrival to pass the horizon, the
jobs released in arrival order, and how far each lane has been offered them.

`push(arrival, id)` queues a request; `due(horizon)` takes the ones whose arrival the horizon
reached (arrival order, ties in push order); `add(job)` appends a released job and returns its
place in the sequence; `offer(i, driver)` offers lane i the jobs it has not seen; `trim()` forgets
the jobs every lane has passed. Pure.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Container, Hashable

from shadow.engine.driver import LaneDriver
from shadow.engine.jobs import Job


class Releases:
    """See module docstring; `lanes`: how many lanes read the sequence (each its own cursor)."""

    def __init__(self, lanes: int) -> None:
        self.pending: list[tuple[float, int, str]] = []  # (arrival, tie, id) releasable, not released
        self._tie = 0
        self.jobs: deque[Job] = deque()
        self.base = 0  # index of jobs[0] in the release sequence
        self.cursor = [0] * lanes  # per lane: the next job in the sequence it has not been offered

    def push(self, arrival: float, rid: str) -> None:
        self._tie += 1
        heapq.heappush(self.pending, (arrival, self._tie, rid))

    def due(self, horizon: float) -> list[tuple[float, str]]:
        """(arrival, id) of the pushed requests that arrived at or before `horizon`, in order."""
        pending = self.pending
        out: list[tuple[float, str]] = []
        while pending and pending[0][0] <= horizon:
            arrival, _, rid = heapq.heappop(pending)
            out.append((arrival, rid))
        return out

    def add(self, job: Job) -> int:
        """Append a released job; its place in the release sequence."""
        seq = self.base + len(self.jobs)
        self.jobs.append(job)
        return seq

    def offer(self, i: int, driver: LaneDriver) -> bool:
        """Offer lane `i` the released jobs it has not seen, each at its arrival; False when the
        lane is held by an unknown end before reaching the next one."""
        released, base = self.jobs, self.base
        cur = self.cursor[i]
        try:
            lane = driver.lane
            while cur - base < len(released):
                job = released[cur - base]
                if job.request_id in lane.seeded:
                    cur += 1  # released after the boundary whose seed put it in the lane
                    continue
                self.cursor[i] = cur  # a re-seed while advancing to the job reads it
                if not driver.offer(job, job.arrival_s):
                    return False
                cur += 1
            return True
        finally:
            self.cursor[i] = cur

    def skip(self, i: int, before: float, seeded: Container[Hashable],
             done: Callable[[Hashable], None]) -> None:
        """Lane `i` jumped ahead: it never takes the released jobs that arrived before lane time
        `before`; `done(id)` for each its seed does not hold (they ended before the boundary)."""
        released, cur = self.jobs, self.cursor[i]
        while cur - self.base < len(released) and released[cur - self.base].arrival_s < before:
            rid = released[cur - self.base].request_id
            if rid not in seeded:
                done(rid)
            cur += 1
        self.cursor[i] = cur

    def trim(self) -> None:
        """Forget the jobs every lane has been offered."""
        low = min(self.cursor)
        while self.base < low:
            self.jobs.popleft()
            self.base += 1
