"""`shadow fleet` as a process: the simulated fleet, or real vLLM CPU servers, until a signal."""

from __future__ import annotations

import asyncio
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING

from shadow.app.process import announce, stop_event
from shadow.fleet.config import FleetConfig
from shadow.fleet.fleet import Fleet

if TYPE_CHECKING:
    from shadow.realvllm.launcher import VllmFleet


async def serve(config: FleetConfig) -> None:
    """Serve every server of the simulated fleet until SIGINT/SIGTERM (OSError: a port)."""
    stop = stop_event()
    async with Fleet(config) as fleet:
        announce(fleet.ready_line())
        await stop.wait()


def run(config: FleetConfig) -> None:
    asyncio.run(serve(config))


class _Stop(Exception):
    """SIGINT/SIGTERM while the servers start."""


def run_vllm(fleet: VllmFleet) -> None:
    """Start every real server, announce them, run until SIGINT/SIGTERM; every server is stopped
    (its whole process group) on the way out. RuntimeError: one did not come up (`StartError`,
    naming it and quoting its log) or exited."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not stop.is_set():
            stop.set()
            raise _Stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        fleet.start()
        announce(fleet.ready_line())
        while not stop.wait(1.0):
            dead = [s.name for s in fleet.servers if s.proc is not None and s.proc.poll() is not None]
            if dead:
                raise RuntimeError(f"vLLM server {dead[0]} exited; stopping the fleet")
    except _Stop:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # the stop below is not to be interrupted
        fleet.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
