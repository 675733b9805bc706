"""Health signals for the mode controller, read from a running `TapService` and `LiveLanes`.

`HealthReader.read(now)` returns `fallback.Signals`: per decode worker the mirror's drift against
the worker's own /metrics, the age of the last good scrape (since start when never scraped), the
workers whose last scrape could not connect; BR-H's calibration error (`CalibrationMonitor`); and
BR-H's net gain over BR-0 in the live lanes. `HealthPoll` runs it every interval on the mirror's
analysis loop (where the reconciler and the mirror live) and hands it to `ModeController.check`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from shadow.active.calibration import CalibrationMonitor
from shadow.active.fallback import Signals
from shadow.active.modes import ModeController

log = logging.getLogger("shadow.active.health")

#: Scrape errors that mean "nothing listens there" (httpx exception names).
UNREACHABLE = frozenset({"ConnectError", "ConnectTimeout"})


def net_gain(lanes: dict[str, Any]) -> tuple[float | None, int]:
    """(BR-0 avg spread − BR-H avg spread) / BR-0 avg spread and the steps it rests on, from the
    live report's lanes; (None, 0) without both lanes or with an idle BR-0 lane."""
    br0 = next((v for k, v in lanes.items() if v.get("policy") == "br0" and k == "br0"), None)
    brh = next((v for v in lanes.values() if v.get("policy") == "brh"), None)
    if br0 is None or brh is None:
        return None, 0
    base = float(br0.get("avg_spread_tokens") or 0.0)
    if base <= 0:
        return None, 0
    gain = (base - float(brh.get("avg_spread_tokens") or 0.0)) / base
    return gain, int(min(br0.get("steps") or 0, brh.get("steps") or 0))


class HealthReader:
    """Reads `Signals` from a tap service (reconciler), live lanes (report) and a calibration
    monitor; any of them may be None (that signal then reads as healthy/absent)."""

    def __init__(self, tap: Any, live: Any = None, calibration: CalibrationMonitor | None = None,
                 *, started: float = 0.0) -> None:
        self.tap = tap
        self.live = live
        self.calibration = calibration
        self.started = started
        self.oracle_gap: float | None = None  # set by the oracle replay (ModeControl)

    def read(self, now: float) -> Signals:
        drift: dict[str, float] = {}
        ages: dict[str, float] = {}
        down: set[str] = set()
        rec = getattr(self.tap, "reconciler", None)
        if rec is not None:
            for name, w in rec.workers.items():
                if w.drift_requests is not None:
                    drift[name] = float(w.drift_requests)
                ages[name] = now - (w.last_ok if w.last_ok is not None else self.started)
                if w.last_error in UNREACHABLE:
                    down.add(name)
        cal, n = None, 0
        if self.calibration is not None:
            self.calibration.update()
            cal, n = self.calibration.error()
        gain, steps = None, 0
        if self.live is not None:
            gain, steps = net_gain(self.live.report().get("lanes", {}))
        return Signals(drift=drift, scrape_age_s=ages, unreachable=frozenset(down), calibration_error=cal,
                       calibration_samples=n, net_gain=gain, net_gain_steps=steps, oracle_gap=self.oracle_gap,
                       scrapes=rec.scrapes if rec is not None else 0)


class HealthPoll:
    """Every `interval_s`: read the signals and let the controller check them."""

    def __init__(self, reader: HealthReader, controller: ModeController, interval_s: float = 0.25) -> None:
        self.reader = reader
        self.controller = controller
        self.interval_s = interval_s
        self.polls = 0

    def once(self) -> None:
        self.controller.check(self.reader.read(self.controller.clock()))
        self.polls += 1

    async def run(self) -> None:
        while True:
            try:
                self.once()
            except Exception:
                log.exception("shadow mode: health poll failed")
            await asyncio.sleep(self.interval_s)
