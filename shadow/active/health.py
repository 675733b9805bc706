"""Health signals for the mode controller, read from the mirror's reconciler and the live lanes.

`HealthReader.read(now)` returns `fallback.Signals`: per decode worker the mirror's drift against
the worker's own /metrics, the age of the last good scrape (since start when never scraped), the
workers whose last scrape could not connect; BR-H's calibration error (`CalibrationMonitor`),
BR-H's net gain over BR-0 in the live lanes, and the last oracle gap. `HealthPoll` runs it every
interval on the mirror's analysis loop (where the reconciler and the mirror live), hands it to
`ModeController.check`, and replays the oracle window off that thread (`replay_oracle`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from shadow.active.calibration import CalibrationMonitor
from shadow.active.fallback import Signals
from shadow.active.modes import ModeController
from shadow.active.oraclegap import OracleGap
from shadow.mirror.reconcile import Reconciler

log = logging.getLogger("shadow.active.health")

#: Scrape errors that mean "nothing listens there" (httpx exception names).
UNREACHABLE = frozenset({"ConnectError", "ConnectTimeout"})
#: ... of which a refused connection is unambiguous; a connect timeout can be a loaded host, so it
#: counts only after this many failed scrapes in a row (as the health check, which reads more often
#: than the scrapes run, sees them).
TIMEOUT_ROUNDS = 2


def net_gain(lanes: Mapping[str, Any]) -> tuple[float | None, int]:
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


class ReportSource(Protocol):
    """What the reader needs of the live lanes: their report (`{"lanes": {label: figures}}`)."""

    def report(self) -> Mapping[str, Any]: ...


class HealthReader:
    """Reads `Signals` from the reconciler, the live lanes and a calibration monitor; any of them
    may be None (that signal then reads as healthy/absent)."""

    def __init__(self, scrapes: Reconciler | None, lanes: ReportSource | None = None,
                 calibration: CalibrationMonitor | None = None, *, started: float = 0.0) -> None:
        self.scrapes = scrapes
        self.lanes = lanes
        self.calibration = calibration
        self.started = started
        self.oracle_gap: float | None = None  # set by the oracle replay (HealthPoll)
        self._timeouts: dict[str, int] = {}  # worker -> its error count at the first timeout in a row

    def read(self, now: float) -> Signals:
        drift: dict[str, float] = {}
        ages: dict[str, float] = {}
        down: set[str] = set()
        rec = self.scrapes
        if rec is not None:
            for name, w in rec.workers.items():
                if w.drift_requests is not None:
                    drift[name] = float(w.drift_requests)
                ages[name] = now - (w.last_ok if w.last_ok is not None else self.started)
                if w.last_error == "ConnectTimeout":
                    first = self._timeouts.setdefault(name, w.errors)
                    if w.errors - first + 1 >= TIMEOUT_ROUNDS:
                        down.add(name)
                else:
                    self._timeouts.pop(name, None)
                    if w.last_error in UNREACHABLE:
                        down.add(name)
        cal, n = None, 0
        if self.calibration is not None:
            self.calibration.update()
            cal, n = self.calibration.error()
        gain, steps = None, 0
        if self.lanes is not None:
            gain, steps = net_gain(self.lanes.report().get("lanes", {}))
        return Signals(drift=drift, scrape_age_s=ages, unreachable=frozenset(down), calibration_error=cal,
                       calibration_samples=n, net_gain=gain, net_gain_steps=steps, oracle_gap=self.oracle_gap,
                       scrapes=rec.scrapes if rec is not None else 0, spread_tokens=self._spread())

    def _spread(self) -> float | None:
        """The fleet's spread now: max − min mirrored KV tokens over the reconciled workers."""
        rec = self.scrapes
        if rec is None or not rec.workers:
            return None
        ws = rec.state.workers
        loads = [float(ws[n].kv_tokens) if n in ws else 0.0 for n in rec.workers]
        return max(loads) - min(loads)


@dataclass
class HealthPoll:
    """Every `interval_s`: read the signals and let the controller check them (`run`); with an
    oracle, replay its window every `oracle_interval_s` while new requests finish (`replay_oracle`)."""

    reader: HealthReader
    controller: ModeController
    interval_s: float = 0.25
    oracle: OracleGap | None = None
    oracle_interval_s: float = 60.0
    polls: int = field(default=0, init=False)

    def once(self) -> None:
        self.controller.check(self.reader.read(self.controller.clock()))
        self.polls += 1

    async def run(self) -> None:
        """Poll until cancelled; a never-scraped worker's age counts from here."""
        self.reader.started = self.controller.clock()
        while True:
            try:
                self.once()
            except Exception:
                log.exception("shadow mode: health poll failed")
            await asyncio.sleep(self.interval_s)

    async def replay_oracle(self) -> None:
        """Replay the window off this thread as soon as it holds enough requests, then every
        `oracle_interval_s` while new ones finish; the reader reports the result."""
        oracle, interval = self.oracle, self.oracle_interval_s
        if oracle is None or not interval > 0:
            return
        seen, last = -1, float("-inf")
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(interval, 2.0))
            if oracle.finished == seen or loop.time() - last < interval:
                continue
            if len(oracle.done) < oracle.min_jobs:
                continue
            seen, last = oracle.finished, loop.time()
            try:
                self.reader.oracle_gap = await asyncio.to_thread(oracle.compute, oracle.jobs())
            except Exception:
                log.exception("shadow mode: oracle gap replay failed")
