"""The twin check of the `actual` lane against the mirrored fleet (the report's `fidelity`).

The mirror's placed load per worker is averaged over each step-time window (`observe` at every
observation, `close_window` at the window's end: (start, end, mean per worker) kept in a ring);
the `actual` lane's placed load is averaged over its steps in the same window (`lane_stepped`),
and the two are compared once the lane passes the window's end (averaging both sides over a
window takes out the phase between the lane's step boundaries and the fleet's)."""

from __future__ import annotations

import operator
from collections import deque

from shadow.contracts.report import FidelityReport
from shadow.engine.lane import Lane
from shadow.engine.servertimes import ServerTimes
from shadow.engine.twincheck import TwinCheck


class FidelityLedger:
    """See module docstring; `workers`: how many."""

    def __init__(self, workers: int) -> None:
        # (window start, end, mean placed load per worker) of the mirror
        self._mirror_ring: deque[tuple[float, float, list[float]]] = deque(maxlen=10_000)
        self._mw_sum = [0.0] * workers
        self._mw_n = 0
        self._mw_start: float | None = None
        self._lw_sum = [0.0] * workers
        self._lw_n = 0
        self.sum = 0.0  # Σ per-snapshot relative error
        self.n = 0
        self.abs = 0.0  # Σ_snapshots Σ_g |lane − mirror|
        self.tot = 0.0  # Σ_snapshots Σ_g mirror
        self.recent: deque[float] = deque(maxlen=120)

    def observe(self, now: float, placed: list[float]) -> None:
        """The mirror's placed load per worker at event time `now`, into the current window."""
        if self._mw_start is None:
            self._mw_start = now
        self._mw_sum = list(map(operator.add, self._mw_sum, placed))
        self._mw_n += 1

    def close_window(self, now: float) -> None:
        """The current window ends at event time `now` (the next one starts there)."""
        if self._mw_start is not None:
            n = self._mw_n
            self._mirror_ring.append((self._mw_start, now, [x / n for x in self._mw_sum]))
        self._mw_sum = [0.0] * len(self._mw_sum)
        self._mw_n = 0
        self._mw_start = now

    def lane_stepped(self, lane: Lane, origin: float) -> None:
        """A step of the `actual` lane ran (`origin`: event time of lane time 0)."""
        ring = self._mirror_ring
        t_event = lane.now + origin
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
            self.abs += diff
            self.tot += total
            self.sum += err
            self.n += 1
            self.recent.append(err)
        if ring and ring[0][0] <= t_event:
            # placed load on both sides: running KV + prompts queued at the worker (+ the lane's
            # requests whose streams have not ended yet: `Lane.placed_loads`)
            for g, x in enumerate(lane.placed_loads()):
                self._lw_sum[g] += x
            self._lw_n += 1

    def report(self, twin: TwinCheck | None, servers: ServerTimes | None,
               workers: list[str]) -> FidelityReport:
        """The twin check. Load-weighted: Σ|lane − mirror| / Σ mirror over all snapshots and workers
        (a near-empty fleet's snapshot weighs as little as its load; the unweighted mean beside it);
        against the engines' own KV where their probe reports it (`twin`, `shadow.engine.twincheck`:
        the mirror sees the HTTP side, whose delays no engine model predicts request by request)."""
        fid_mirror = self.abs / self.tot if self.tot > 0 else None
        figures = None if twin is None else twin.figures()
        fid_engine = None if figures is None else figures["kv_vs_engine"]
        recent = self.recent
        return {
            "load_rel_error": fid_engine if fid_engine is not None else fid_mirror,
            "reference": "engine" if fid_engine is not None else "mirror",
            "load_rel_error_mirror": fid_mirror,
            "load_rel_error_unweighted": self.sum / self.n if self.n else None,
            "load_rel_error_recent": sum(recent) / len(recent) if recent else None,
            "samples": self.n,
            # time averages per window, against the mirror and the engines' own steps, and what the
            # twin measured of the servers
            "twin": figures,
            "servers": None if servers is None else servers.describe(workers),
        }
