"""Assembly of the mode controller inside `shadow serve` (one call from `ServeService`).

`ModeControl(config, tap, live)` builds the `ModeController`, its calibration monitor (a mirror
listener), the health poll, the flag-file watcher, the admin routes on the API app and the
Prometheus collector on the serve registry. `start()` runs the poll and the watcher on the
mirror's analysis loop (where the reconciler lives); `stop()` cancels them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from shadow.active.admin import add_mode_routes
from shadow.active.calibration import CalibrationMonitor
from shadow.active.flagfile import FlagFileWatcher
from shadow.active.health import HealthPoll, HealthReader
from shadow.active.mode_metrics import ModeCollector
from shadow.active.modes import ModeConfig, ModeController
from shadow.active.oraclegap import OracleGap
from shadow.core.params import BRParams

log = logging.getLogger("shadow.active.control")


class ModeControl:
    """See module docstring. `controller` is the `ModeSource` the active proxy asks."""

    def __init__(self, config: ModeConfig, tap: Any, live: Any = None, *, br: BRParams | None = None) -> None:
        self.config = config
        self.tap = tap
        br = br or BRParams()
        self.controller = ModeController(config, clock=tap.clock)
        self.calibration = CalibrationMonitor(br.horizon)
        tap.mirror.listeners.append(self.calibration)
        self.oracle = (
            OracleGap(len(live.workers), live.slots, live.step, br)
            if live is not None and config.oracle_interval_s > 0
            else None
        )
        if self.oracle is not None:
            tap.mirror.listeners.append(self.oracle)
        self.reader = HealthReader(tap, live, self.calibration, started=tap.clock())
        self.poll = HealthPoll(self.reader, self.controller, config.check_interval_s)
        self.watcher = (
            FlagFileWatcher(config.mode_file, self.controller, config.mode_file_interval_s)
            if config.mode_file
            else None
        )
        if self.watcher is not None:
            self.watcher.poll()  # the file at start wins over the environment's mode
        self.rejected: dict[str, int] = {}
        add_mode_routes(tap.app, self.controller, config.admin_token, rejected=self.rejected,
                        view=self.report)
        tap.registry.register(ModeCollector(self.controller, self.calibration))
        self._tasks: list[asyncio.Task[Any]] = []

    def start(self) -> None:
        """Start the poll (and the watcher) on the tap service's analysis loop."""
        self.reader.started = self.tap.clock()
        self.tap.analysis.submit(self._spawn())

    async def _spawn(self) -> None:
        self._tasks.append(asyncio.create_task(self.poll.run()))
        if self.watcher is not None:
            self._tasks.append(asyncio.create_task(self.watcher.run()))
        if self.oracle is not None:
            self._tasks.append(asyncio.create_task(self._oracle_loop(self.oracle)))

    async def _oracle_loop(self, oracle: OracleGap) -> None:
        """Replay the window off this thread as soon as it holds enough requests, then every
        `oracle_interval_s` while new ones finish; the reader reports the result."""
        interval = self.config.oracle_interval_s
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

    async def _cancel(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def stop(self) -> None:
        """Cancel the poll and the watcher (before the tap service stops its analysis loop)."""
        if self.tap.analysis.running and self._tasks:
            await asyncio.wrap_future(self.tap.analysis.submit(self._cancel()))

    def report(self) -> dict[str, Any]:
        """`/v1/report`'s "mode" section."""
        out = self.controller.snapshot()
        out["admin"] = {"put_enabled": self.config.admin_token is not None, "rejected": dict(self.rejected)}
        return out
