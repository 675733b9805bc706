"""The mode controller of `shadow serve` with what drives and shows it.

`ModeControl(config, clock=...)` holds the `ModeController`, BR-H's calibration monitor (a mirror
listener), the flag-file watcher, the GET/PUT /v1/mode routes and the Prometheus collector; its
owner wires them into the mirror and runs the watcher on the mirror's analysis loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shadow.active.admin import mode_router
from shadow.active.calibration import CalibrationMonitor
from shadow.active.flagfile import FlagFileWatcher
from shadow.active.mode_metrics import ModeCollector
from shadow.active.modes import ModeConfig, ModeController
from shadow.core.params import BRParams
from shadow.telemetry.tracing import RoutingSpans


class ModeControl:
    """See module docstring. `controller` is the `ModeSource` the active proxy asks."""

    def __init__(
        self,
        config: ModeConfig,
        *,
        clock: Callable[[], float],
        br: BRParams | None = None,
        spans: RoutingSpans | None = None,
    ) -> None:
        self.config = config
        self.controller = ModeController(config, clock=clock, spans=spans)
        self.calibration = CalibrationMonitor((br or BRParams()).horizon)
        self.watcher = (
            FlagFileWatcher(config.mode_file, self.controller, config.mode_file_interval_s)
            if config.mode_file
            else None
        )
        if self.watcher is not None:
            self.watcher.poll()  # the file at start wins over the environment's mode
        self.rejected: dict[str, int] = {}
        self.router = mode_router(self.controller, config.admin_token, self.report, self.rejected)
        self.collector = ModeCollector(self.controller, self.calibration)

    def report(self) -> dict[str, Any]:
        """`/v1/report`'s "mode" section (and GET /v1/mode)."""
        out = self.controller.snapshot()
        out["admin"] = {"put_enabled": self.config.admin_token is not None, "rejected": dict(self.rejected)}
        gate = self.controller.gate
        out["leader"] = None if gate is None else gate()
        return out
